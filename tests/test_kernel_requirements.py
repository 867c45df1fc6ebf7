"""The KV-dtype -> kernels table of KV_DTYPES.md and the start-up check built on it.

Modules compile into the user's kernel cache (warm after the first run of the suite)."""

import json

import pytest
from typer.testing import CliRunner

from metrale_cli.cli import app
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.kv_kernels import required_kernels
from metrale_cli.kernels.registry import module_for
from metrale_cli.kernels.requirements import missing_kernels, validate_required_kv_kernels
from metrale_cli.kernels.validate import SKIPPED, validate_kernels
from metrale_cli.kv.dtypes import KV_DTYPES, KvCacheDtype, concrete, is_wht_rotated, kv_pair

WHT = ["wht_bf16::wht_bf16_inplace", "wht_bf16::wht_bf16_inplace_inv"]


def names(dtype, head_dim):
    return [str(k) for k in required_kernels(concrete(dtype), head_dim)]


def test_every_dtype_has_a_row():
    assert set(KV_DTYPES) == set(KvCacheDtype)
    for d in KvCacheDtype:
        assert len(names(d, 128)) >= 2


@pytest.mark.parametrize("dtype", list(KvCacheDtype))
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_every_required_kernel_is_in_the_registry(dtype, head_dim):
    for spec in required_kernels(dtype, head_dim):
        assert module_for(spec) is not None, spec
    assert (WHT[0] in names(dtype, head_dim)) == any(is_wht_rotated(s) for s in kv_pair(dtype))


@pytest.mark.parametrize(
    "dtype, head_dim, expected",
    [
        ("bf16", 128, ["reshape_and_cache::reshape_and_cache_flash", "paged_decode::paged_decode_attn"]),
        ("fp8", 256, ["reshape_and_cache::reshape_and_cache_flash_fp8", "paged_decode_fp8::paged_decode_attn_fp8"]),
        ("nvfp4", 64, ["reshape_and_cache::reshape_and_cache_flash_nvfp4", "paged_decode_nvfp4::paged_decode_attn_nvfp4"]),
        ("turbo4", 128, ["reshape_and_cache_turbo::reshape_and_cache_flash_turbo4",
                         "paged_decode_turbo4_128::paged_decode_attn_turbo4",
                         "prefill_paged_turbo4::attn_prefill_paged_turbo4_64"] + WHT),
        ("turbo4", 256, ["reshape_and_cache_turbo::reshape_and_cache_flash_turbo4",
                         "paged_decode_turbo4::paged_decode_attn_turbo4",
                         "prefill_paged_turbo4::attn_prefill_paged_turbo4_64"] + WHT),
        ("turbo2", 256, ["reshape_and_cache_turbo::reshape_and_cache_flash_turbo2",
                         "paged_decode_turbo2_128::paged_decode_attn_turbo2",
                         "prefill_paged_turbo2::attn_prefill_paged_turbo2"] + WHT),
        ("turbo4k3v", 256, ["reshape_and_cache_turbo::reshape_and_cache_flash_turbo4k_turbo3v",
                            "paged_decode_turbo4k_turbo3v_128::paged_decode_attn_turbo4k_turbo3v",
                            "prefill_paged_turbo4k_turbo3v::attn_prefill_paged_turbo4k_turbo3v_64"] + WHT),
        ("fp8k_turbo2v", 256, ["reshape_and_cache_turbo::reshape_and_cache_flash_fp8k_turbo2v",
                               "paged_decode_fp8k_turbo2v::paged_decode_attn_fp8k_turbo2v",
                               "prefill_paged_fp8k_turbo2v::attn_prefill_paged_fp8k_turbo2v_64"] + WHT),
    ],
)
def test_exact_required_lists(dtype, head_dim, expected):
    assert names(dtype, head_dim) == expected


def test_missing_kernels_reports_every_reason_not_the_first():
    seen = []

    def nothing_works(spec):
        seen.append(str(spec))
        return "broken"

    assert missing_kernels("turbo3", 128, nothing_works) == names("turbo3", 128)
    assert seen == names("turbo3", 128)
    assert missing_kernels("turbo3", 128, lambda spec: None) == []


@pytest.mark.parametrize("dtype", list(KvCacheDtype))
def test_every_dtype_validates_clean_on_cpu(dtype):
    kernels = validate_required_kv_kernels(dtype, 128)
    assert [str(k) for k in kernels] == names(dtype, 128)
    report = validate_kernels(dtype, 128, on_gpu=False)
    assert report.ok, [r for r in report.rows if not r.ok]
    assert {r.numeric for r in report.rows} == {SKIPPED}
    assert {r.symbol for r in report.rows} == {"exported"}
    rotated = any(is_wht_rotated(s) for s in kv_pair(dtype))
    # 14 dtype-independent (3 gemm_rows variants, its SwiGLU entry, the gated o_proj GEMV) + write, decode, split combine, prefill
    # (+ the two WHT bookends)
    # + the fused QK-norm / RoPE / write + the tensor-core decode (+ bf16 / fp8's decode attention in
    # one launch and its entry that preloads a tile)
    fused = dtype in (KvCacheDtype.BF16, KvCacheDtype.FP8)
    pair = dtype.row.tensor_core.pair  # (+ the batch-1 pair entry)
    assert len(report.rows) == 20 + 2 * rotated + 2 * fused + pair


def test_the_cold_compile_time_is_the_wall_time_of_modules_compiled_side_by_side(monkeypatch):
    """Worker processes compile the cold modules side by side: each reports its own time (here 10 s
    each, in a compile phase of 0.2 s of wall time), and the report's cold compile is the phase's
    wall time, a part of the run's total, not their sum."""
    import time

    from metrale_cli.kernels import validate
    from metrale_cli.kernels.compile import CompileResult

    def side_by_side(modules):
        time.sleep(0.2)
        return {m.name: CompileResult(m.name, True, m.functions, "", "nvrtc", 10.0, False) for m in modules}

    monkeypatch.setattr(validate, "check_modules", side_by_side)
    report = validate_kernels("bf16", 128, on_gpu=False)
    assert 0.2 <= report.cold_compile_seconds <= report.total_seconds < 10.0


@pytest.mark.parametrize("dtype", [d.value for d in KvCacheDtype] + ["fp8k4v"])
def test_validate_kernels_command_exits_0_on_cpu(dtype):
    result = CliRunner().invoke(app, ["validate-kernels", "--kv-cache-dtype", dtype, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and report["missing"] == [] and not report["on_gpu"]
    assert names(dtype, 128)[1] in [k["kernel"] for k in report["kernels"]]


def test_a_head_dim_a_module_is_not_built_for_is_named_in_one_message(monkeypatch):
    """Every dtype is built for head_dim 512; a build whose turbo2 decode stops at 256 names it."""
    import dataclasses

    from metrale_cli.kernels import registry

    assert all(validate_kernels(d, 512, on_gpu=False).ok for d in ("bf16", "fp8", "turbo2", "turbo4k3v"))
    name = "paged_decode_turbo2_128"
    monkeypatch.setitem(registry.MODULES, name, dataclasses.replace(registry.MODULES[name], head_dims=(64, 128, 256)))
    with pytest.raises(MetraleError) as info:
        validate_required_kv_kernels(KvCacheDtype.TURBO2, 512)
    assert info.value.message == (
        "kv-cache-dtype turbo2 (head_dim 512) requires kernel(s) missing from this build: "
        "paged_decode_turbo2_128::paged_decode_attn_turbo2 (turbo2 is experimental)"
    )
    assert "built for head_dim 64/128/256 only" in info.value.hint
    report = validate_kernels("turbo2", 512, on_gpu=False)  # the table names the split combine too
    assert [r.kernel for r in report.rows if not r.ok] == ["paged_decode_turbo2_128::paged_decode_attn_turbo2",
                                                          "paged_decode_turbo2_128::paged_decode_combine_turbo2"]
    assert validate_kernels("turbo4", 512, on_gpu=False).ok


def test_a_kernel_missing_from_the_build_fails_with_the_full_list(monkeypatch):
    from metrale_cli.kernels import registry

    for name in ("reshape_and_cache_turbo", "prefill_paged_turbo3", "wht_bf16"):
        monkeypatch.delitem(registry.MODULES, name)
    with pytest.raises(MetraleError) as info:
        validate_required_kv_kernels(KvCacheDtype.TURBO3, 128)
    assert info.value.message == (
        "kv-cache-dtype turbo3 (head_dim 128) requires kernel(s) missing from this build: "
        "reshape_and_cache_turbo::reshape_and_cache_flash_turbo3, "
        "prefill_paged_turbo3::attn_prefill_paged_turbo3_64, "
        "wht_bf16::wht_bf16_inplace, wht_bf16::wht_bf16_inplace_inv (turbo3 is experimental)"
    )
    assert "not in this build" in info.value.hint
    progress = []
    report = validate_kernels("turbo3", 128, progress=lambda k, i, n: progress.append((i, n)), on_gpu=False)
    # the total first (-1: the modules compile before the first row), then a call a kernel
    assert not report.ok and progress == [(-1, 23)] + [(i, 23) for i in range(23)]  # with its pair entry
    missing = [r.kernel for r in report.rows if not r.ok]
    assert all(r.compiled.startswith("missing") for r in report.rows if not r.ok)
    assert "paged_decode_turbo3_128::paged_decode_attn_turbo3" not in missing and len(missing) == 4


def test_auto_is_not_a_concrete_dtype():
    with pytest.raises(MetraleError):
        validate_required_kv_kernels("auto", 128)


def _gpu_checker(tmp_path, head_dim=128, recheck=False, gpu="H200 sm_90 driver 13000"):
    """A GPU checker whose loads succeed and whose verdicts live under ``tmp_path`` (no GPU)."""
    from metrale_cli.kernels import validate

    class Loader:
        events: list = []

        def function(self, spec, device):
            return object()

    store = validate.VerdictStore(tmp_path / "verified", gpu, "sm_90")
    return validate._GpuChecker(head_dim, recheck, {}, loader=Loader(), verdicts=store, device=0)


def test_a_numeric_check_that_raises_fails_its_row_not_the_table(monkeypatch, tmp_path):
    """E.g. bf16's cache write at head_dim 512: its check reads back through the dtype's decode,
    which does not serve 512. The row says so; the other rows are still checked."""
    from metrale_cli.kernels import checks
    from metrale_cli.kernels.registry import KernelSpec

    def check(ops, head_dim):
        raise MetraleError(f"kernel(s) x do not serve head_dim {head_dim}")

    write = KernelSpec.parse("reshape_and_cache::reshape_and_cache_flash")
    monkeypatch.setitem(checks.NUMERIC_CHECKS, str(write), check)
    row, _ = _gpu_checker(tmp_path, head_dim=512).row(write)
    assert not row.ok and row.numeric == "kernel(s) x do not serve head_dim 512"


def test_numeric_verdicts_are_reused_on_the_same_gpu_only(monkeypatch, tmp_path):
    """A passed check is recorded: the next run on the same GPU reuses it without running it;
    --recheck, another GPU, or a failed check runs it again."""
    from metrale_cli.kernels import checks
    from metrale_cli.kernels.registry import KernelSpec

    spec = KernelSpec.parse("rmsnorm::rms_norm_bf16")
    calls, verdict = [], [None]
    monkeypatch.setitem(checks.NUMERIC_CHECKS, str(spec), lambda ops, hd: calls.append(hd) or verdict[0])
    verdict[0] = "max |err| 1 at 1 of 7 elements"
    assert _gpu_checker(tmp_path).row(spec)[0].numeric == verdict[0] and len(calls) == 1
    assert _gpu_checker(tmp_path).row(spec)[0].numeric == verdict[0] and len(calls) == 2  # not recorded
    verdict[0] = None
    assert _gpu_checker(tmp_path).row(spec)[0].numeric == "matches reference" and len(calls) == 3
    row = _gpu_checker(tmp_path).row(spec)[0]
    assert (row.numeric, row.ok, len(calls)) == ("matches reference (cached)", True, 3)
    assert _gpu_checker(tmp_path, recheck=True).row(spec)[0].numeric == "matches reference" and len(calls) == 4
    assert _gpu_checker(tmp_path, gpu="H100 sm_90 driver 13000").row(spec)[0].numeric == "matches reference"
    assert _gpu_checker(tmp_path, head_dim=64).row(spec)[0].numeric == "matches reference" and len(calls) == 6


def test_validate_imports_no_torch():
    """The start-up check's tables and validate-kernels' warm path load without torch."""
    import subprocess
    import sys

    code = ("import sys, metrale_cli.kernels.validate, metrale_cli.kernels.kv_kernels, metrale_cli.kernels.loader, "
            "metrale_cli.commands.validate, metrale_cli.cli; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
