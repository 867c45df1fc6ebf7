"""Every registered kernel module compiles to an sm_90 cubin and exports exactly its functions.

The modules compile once per source version into the user's kernel cache (the cold compile of
all of them runs in parallel processes); the cache behaviour itself is checked in a private
folder.
"""

import dataclasses
import re
import shutil

import pytest

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import compile as kc
from metrale_cli.kernels.kv_kernels import every_kernel
from metrale_cli.kernels.registry import KERNELS_DIR, MODULES, KernelSpec, all_kernels, module_for
from metrale_cli.kernels.table import TC_PAIR_CTAS_PER_SM
from metrale_cli.kv.dtypes import KV_DTYPES, KvCacheDtype, kv_pair


@pytest.fixture(scope="module")
def compiled():
    return kc.check_modules(MODULES.values())


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_compiles_and_exports_its_functions(compiled, name):
    result = compiled[name]
    assert result.ok, result.log
    assert result.symbols == tuple(sorted(MODULES[name].functions))


def test_the_timeline_builds_compile():
    """The measuring build of tools/decode_timeline.py (METRALE_TIMELINE: thread 0 of each CTA
    stamps the global timer) compiles for every module it times and keeps their functions."""
    from tools.decode_timeline import TIMED

    timed = [dataclasses.replace(MODULES[n], defines=MODULES[n].defines + (("METRALE_TIMELINE", "1"),))
             for n in TIMED]
    results = kc.check_modules(timed)
    for module in timed:
        result = results[module.name]
        assert result.ok, result.log
        assert set(module.functions) <= set(result.symbols)


@pytest.mark.parametrize("name", ["paged_decode_tc", "moe"])
def test_the_row_marks_build_compiles(name):
    """tools/decode_timeline.py --row-marks: the one-launch decode's module (its staged rows) and
    moe.cu (the router's routing warp) with nine marks a CTA."""
    from tools.decode_timeline import ROW_MARKS

    module = MODULES[name]
    module = dataclasses.replace(module, defines=module.defines + (("METRALE_TIMELINE", "1"),
                                                                   ("TL_MARKS", str(ROW_MARKS))))
    cubin, log = kc.compile_cubin(module)
    assert cubin is not None, log
    assert set(module.functions) <= set(kc.function_symbols(cubin))


def test_warm_check_is_served_from_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path))
    module = MODULES["rope"]
    first = kc.check_module(module)
    again = kc.check_module(module)
    assert not first.cached and again.cached and again.seconds == 0.0
    assert again.symbols == first.symbols == ("rope_neox_bf16",)


def test_parallel_cold_compiles_report_the_workers_own_results(tmp_path, monkeypatch):
    """Compiled in worker processes: each module's result is the worker's (not cached, its
    compile time), not the parent's re-read of the cache the workers wrote; then cached."""
    if kc.compiler_id() is None:
        pytest.skip("no CUDA compiler here")
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path))
    modules = [MODULES["rope"], MODULES["activation"]]
    cold = kc.check_modules(modules, workers=2)
    assert all(not r.cached and r.seconds > 0 and r.ok for r in cold.values())
    warm = kc.check_modules(modules, workers=2)
    assert all(r.cached and r.seconds == 0.0 for r in warm.values())


def test_side_defines_select_the_variant_names():
    plain, fp8 = MODULES["paged_decode"], MODULES["paged_decode_fp8"]
    assert plain.path == fp8.path  # one body, many modules
    assert dict(plain.defines) == {"K_SIDE": "bf16", "V_SIDE": "bf16", "KV_SUFFIX": "", "ATTN_MAX_D": "512",
                                   "ATTN_MIN_CTAS": "1"}  # paged_attention.cuh's defaults, spelled out
    assert ("K_SIDE", "fp8") in fp8.defines and ("KV_SUFFIX", "_fp8") in fp8.defines
    assert kc.source_digest(plain) != kc.source_digest(fp8)
    pair = dict(MODULES["paged_decode_fp8k_turbo4v_128"].defines)
    assert pair == {"K_SIDE": "fp8", "V_SIDE": "turbo4", "KV_SUFFIX": "_fp8k_turbo4v", "ATTN_MAX_D": "256",
                    "ATTN_MIN_CTAS": "1"}
    assert dict(MODULES["prefill_paged_turbo3"].defines)["KV_SUFFIX"] == "_turbo3_64"
    assert MODULES["paged_decode_turbo3"].head_dims == (64, 128, 256, 512)
    assert MODULES["paged_decode_turbo3_128"].head_dims == (64, 128, 256)


def test_every_attention_module_is_one_of_two_sources():
    sources = {m.source for n, m in MODULES.items() if n.startswith(("paged_decode", "prefill_paged"))}
    assert sources == {"paged_decode.cu", "prefill_paged.cu", "paged_decode_tc.cu"}  # + the tensor-core decode
    assert [n for n, m in MODULES.items() if m.source == "paged_decode_tc.cu"] == ["paged_decode_tc", "paged_decode_tc_wide"]
    for d in KvCacheDtype:
        k, v = (s.value for s in kv_pair(d))
        defines = dict(MODULES[f"prefill_paged{d.suffix}"].defines)
        assert (defines["K_SIDE"], defines["V_SIDE"]) == (k, v)


def test_byte_exact_modules_compile_without_fma_contraction():
    for name in ("reshape_and_cache", "reshape_and_cache_turbo", "wht_bf16"):
        assert "--fmad=false" in MODULES[name].options()
    assert "--fmad=false" not in MODULES["paged_decode"].options()
    a, b = MODULES["wht_bf16"], MODULES["rope"]
    assert kc.source_digest(a) != kc.source_digest(type(a)(a.name, a.source, a.defines, a.functions))
    assert b.flags == ()


def test_digest_covers_every_included_header():
    files = {p.name for p in kc.included_sources(MODULES["prefill_paged"].path.resolve())}
    assert files == {"prefill_paged.cu", "paged_attention.cuh", "kv_formats.cuh", "numeric.cuh", "reduce.cuh"}
    files = {p.name for p in kc.included_sources(MODULES["reshape_and_cache_turbo"].path.resolve())}
    assert files == {"reshape_and_cache_turbo.cu", "kv_write.cuh", "kv_formats.cuh", "wht.cuh", "numeric.cuh"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_nvcc_fallback_gives_the_same_symbols():
    cubin, log = kc.compile_cubin(MODULES["reshape_and_cache"], compiler="nvcc")
    assert cubin is not None, log
    assert kc.function_symbols(cubin) == (
        "reshape_and_cache_flash", "reshape_and_cache_flash_fp8", "reshape_and_cache_flash_nvfp4")


def test_an_in_process_compile_leaves_the_interpreter_s_shared_bytes_alone(tmp_path, monkeypatch):
    """NVRTC writes its log and cubin into the buffers it is given. A one-byte log (an empty log,
    its NUL) into ``b" " * 1`` wrote into CPython's shared one-byte object: every b" " of the
    process became b"\\x00" (a GGUF cache header padded with spaces then read back as corrupt)."""
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path))
    cubin, log = kc.compile_cubin(MODULES["rope"], compiler="nvrtc")
    assert cubin is not None and log == ""
    assert bytes([32]) == b"\x20" and (b" " * 1).decode() == " "


def test_symbol_reader_rejects_non_elf():
    with pytest.raises(ValueError):
        kc.function_symbols(b"not an elf image at all, certainly")


def test_registry_walk():
    names = [str(k) for k in all_kernels()]
    # 4 core + 4 decode GEMVs + the decode step's end + 4 projections of up to 16 rows + 8 MoE (6 decode, 2 prefill) + 7 GDN (decode and
    # batch 1's decode; the prefill's conv, inputs, chunk prep, walk and gated norm) + 2 WHT + 3 + 13
    # writes + 16 fused rope_and_cache + (16 tensor-core decodes + the bf16 / fp8 one-launch decodes) at
    # head_dim 64 / 128 and at 256 + 3 batch-1 pair entries (64 / 128) + 16 dtypes x (a prefill and a
    # (decode, combine) pair per decode module) + 2 one-shot collectives
    decode_modules = sum(len(row.decode) for row in KV_DTYPES.values())
    assert len(names) == len(set(names)) == 4 + 5 + 1 + 4 + 8 + 7 + 2 + 16 + 16 + 2 * (16 + 4) + 3 + 16 + 2 * decode_modules + 2 == 174
    assert set(every_kernel()) == set(all_kernels())  # every registered kernel is launched by some dtype
    for spec in all_kernels():
        assert module_for(spec).path.is_file()
    assert module_for(KernelSpec("paged_decode", "paged_decode_attn_fp8")) is None
    assert str(KernelSpec.parse("rope::rope_neox_bf16")) == "rope::rope_neox_bf16"
    with pytest.raises(MetraleError):
        KernelSpec.parse("rope_neox_bf16")


@pytest.mark.parametrize("source, macro", [("rope_and_cache.cu", "METRALE_ROPE_CACHE_ENTRY"),
                                           ("reshape_and_cache_turbo.cu", "METRALE_WRITE_ENTRY")])
def test_cuda_entry_lists_equal_the_dtype_table(source, macro):
    """The entry points a templated source instantiates (dtype, K side, V side) are the table's
    rows, side for side: a wrong pair would compile and export, and write the wrong bytes."""
    text = (KERNELS_DIR / source).read_text()
    entries = re.findall(rf"^{macro}\((\w+), (\w+), (\w+)\)$", text, flags=re.M)
    want = [(d.value, *(s.value for s in kv_pair(d))) for d in KvCacheDtype
            if macro != "METRALE_WRITE_ENTRY" or d.row.write.module == "reshape_and_cache_turbo"]
    assert sorted(entries) == sorted(want)


def test_tensor_core_entries_equal_the_dtype_table():
    """paged_decode_tc.cu's entries: a decode per dtype with a tensor-core row, its K and V formats
    the row's sides, and a one-launch decode where the row has one (fp8 flag); __launch_bounds__
    minimums as the row says (the host sizes its splits by that minimum); the batch-1 pair entries
    where the row has one, at the host's TC_PAIR_CTAS_PER_SM."""
    text = (KERNELS_DIR / "paged_decode_tc.cu").read_text()
    entries = re.findall(r"^METRALE_TC_ENTRY\((\w+), (\w+), (\w+), (\w+), (\w+)\)$", text, flags=re.M)
    sides = {d: tuple(f"TC_{s.value.upper()}" for s in kv_pair(d)) for d in KvCacheDtype}
    assert entries == [(f"paged_decode_attn_tc{d.suffix}", *sides[d], str(row.tensor_core.ctas_per_sm), "false")
                       for d, row in KV_DTYPES.items() if row.tensor_core] + [
                       (f"paged_decode_attn_tc_pair{d.suffix}", *sides[d], "TC_PAIR_CTAS", "true")
                       for d, row in KV_DTYPES.items() if row.tensor_core and row.tensor_core.pair]
    assert len(entries) == len(KvCacheDtype) + 3
    assert re.search(rf"^#define TC_PAIR_CTAS {TC_PAIR_CTAS_PER_SM}$", text, flags=re.M)
    entries = re.findall(r"^METRALE_ROPE_TC_ENTRY\((\w+), (\w+), (\d+), (\w+)\)$", text, flags=re.M)
    assert entries == [(f"paged_decode_rope_tc{p}{d.suffix}", str(d == KvCacheDtype.FP8).lower(),
                        str(row.tensor_core.ctas_per_sm), str(bool(p)).lower())
                       for p in ("", "_preload") for d, row in KV_DTYPES.items()
                       if row.tensor_core and row.tensor_core.one_launch]


def _top_level_blocks(source: str) -> list[str]:
    """The text of each top-level brace block (function bodies, also inside macros) of a CUDA
    source with its comments removed."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.S)
    blocks, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                blocks.append(text[start:i + 1])
    assert depth == 0, "unbalanced braces"
    return blocks


def _triggers_before_waits(source: str) -> int:
    """Function bodies of ``source`` that trigger their dependents before any PDL wait."""
    early = 0
    for block in _top_level_blocks(source):
        trigger, wait = block.find("pdl_launch_dependents()"), block.find("pdl_wait()")
        early += trigger >= 0 and (wait < 0 or trigger < wait)
    return early


def test_every_programmatic_kernel_triggers_after_its_wait():
    # pdl.cuh's rule: work before a kernel's wait may read what launches two or more back wrote,
    # which holds only if no kernel lets its dependent start before its own wait.
    tools = KERNELS_DIR.parent / "tools"
    sources = [p for p in sorted([*KERNELS_DIR.rglob("*.cu*"), *tools.rglob("*.cu")]) if p.name != "pdl.cuh"]
    users = [p for p in sources if "pdl_launch_dependents()" in p.read_text()]
    assert {p.name for p in users} >= {"gemv.cu", "paged_decode_tc.cu", "rope_and_cache.cu", "decode_stack.cu",
                                         "rmsnorm.cu", "wht_bf16.cu"}
    assert [p.name for p in users if _triggers_before_waits(p.read_text())] == []
    assert _triggers_before_waits("void f() { pdl_launch_dependents(); pdl_wait(); }") == 1
    assert _triggers_before_waits("void f() { pdl_wait(); /* pdl_launch_dependents(); */ }\n"
                                  "void g() { if (x) { pdl_launch_dependents(); } }") == 1


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_every_module_but_the_sm_90_projections_compiles_for_older_gpus(arch):
    """An A100 (sm_80) or an Ada GPU (sm_89): e4m3 converted in software below sm_89 and bf16
    products rounded through fp32 below sm_90 (numeric.cuh, mma.cuh), so every module compiles and
    exports its kernels but gemm_rows.cu's, which the cuda backend does not load there
    (table.SM90_KERNELS); and those do need sm_90 (else the list would be stale)."""
    from metrale_cli.kernels.table import SM90_KERNELS

    sm90 = {module_for(s).name for s in SM90_KERNELS}
    assert all(set(MODULES[name].functions) == {s.function for s in SM90_KERNELS if module_for(s).name == name}
               for name in sm90)
    results = kc.check_modules([m for m in MODULES.values() if m.name not in sm90], arch)
    failed = {name: (r.log.splitlines() or ["?"])[-1] for name, r in results.items() if not r.ok}
    assert not failed
    assert all(r.symbols == tuple(sorted(MODULES[name].functions)) for name, r in results.items())
    assert not any(kc.check_module(MODULES[name], arch).ok for name in sm90)

