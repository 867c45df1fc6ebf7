"""Every registered kernel module compiles to an sm_90 cubin and exports exactly its functions."""

import shutil

import pytest

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import compile as kc
from metrale_cli.kernels.registry import MODULES, KernelSpec, all_kernels, module_for


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("METRALE_CACHE_DIR", str(tmp_path_factory.mktemp("metrale-cache")))
    yield
    mp.undo()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_compiles_and_exports_its_functions(cache, name):
    module = MODULES[name]
    result = kc.check_module(module)
    assert result.ok, result.log
    assert result.symbols == tuple(sorted(module.functions))


def test_warm_check_is_served_from_the_disk_cache(cache):
    module = MODULES["rope"]
    first = kc.check_module(module)
    again = kc.check_module(module)
    assert again.cached and again.seconds == 0.0
    assert again.symbols == first.symbols == ("rope_neox_bf16",)


def test_fp8_define_selects_the_variant_names():
    plain, fp8 = MODULES["paged_decode"], MODULES["paged_decode_fp8"]
    assert plain.path == fp8.path  # one body, two modules
    assert ("KV_FP8", "1") in fp8.defines and not plain.defines
    assert kc.source_digest(plain) != kc.source_digest(fp8)


def test_digest_covers_every_included_header():
    files = {p.name for p in kc.included_sources(MODULES["prefill_paged"].path.resolve())}
    assert files == {"prefill_paged.cu", "paged_attention.cuh", "numeric.cuh", "reduce.cuh"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_nvcc_fallback_gives_the_same_symbols(tmp_path):
    cubin, log = kc.compile_cubin(MODULES["reshape_and_cache"], compiler="nvcc")
    assert cubin is not None, log
    assert kc.function_symbols(cubin) == ("reshape_and_cache_flash", "reshape_and_cache_flash_fp8")


def test_symbol_reader_rejects_non_elf():
    with pytest.raises(ValueError):
        kc.function_symbols(b"not an elf image at all, certainly")


def test_registry_walk():
    names = [str(k) for k in all_kernels()]
    assert len(names) == len(set(names)) == 12
    for spec in all_kernels():
        assert module_for(spec).path.is_file()
    assert module_for(KernelSpec("paged_decode", "paged_decode_attn_fp8")) is None
    assert str(KernelSpec.parse("rope::rope_neox_bf16")) == "rope::rope_neox_bf16"
    with pytest.raises(MetraleError):
        KernelSpec.parse("rope_neox_bf16")


class RecordingLoader:
    """Stands in for the CuPy loader: records launches so grids and signatures can be checked."""

    def __init__(self):
        self.calls = []

    def launch(self, spec, sig, grid, block, *args):
        assert len(sig.params) == len(args)
        self.calls.append((str(spec), tuple(grid), tuple(block), dict(zip((n for n, _ in sig.params), args))))


def test_cuda_ops_pick_kernels_grids_and_splits(monkeypatch):
    import torch

    from metrale_cli.kernels import cuda_ops

    monkeypatch.setattr(cuda_ops, "_sm_count", lambda index: 132)
    monkeypatch.setattr(cuda_ops, "_ready", lambda t: t.contiguous())
    loader = RecordingLoader()
    ops = cuda_ops.CudaOps(loader)
    cache = torch.zeros(64, 16, 8, 128, dtype=torch.float8_e4m3fn)
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    tables, lens, scale = torch.zeros(1, 64, dtype=torch.int32), torch.tensor([999], dtype=torch.int32), torch.ones(1)
    ops.paged_decode(q, cache, cache, tables, lens, 0.1, scale, scale)
    (decode, d_grid, _, d_args), (combine, c_grid, _, c_args) = loader.calls
    assert decode == "paged_decode_fp8::paged_decode_attn_fp8" and combine.endswith("paged_decode_combine_fp8")
    # 8 KV heads x 1 sequence x 1 head chunk = 8 CTAs: 32 splits (the cap; 64 blocks * 16 keys
    # would allow 32 splits of 32 keys, and 2 waves of 132 SMs want 33).
    assert d_grid == (8, 1, 32) and d_args["num_splits"] == 32 and c_grid == (32, 1)
    assert d_args["part_o"].shape == (1, 32, 32, 128)
    loader.calls.clear()
    ops.paged_prefill(torch.zeros(19, 32, 256, dtype=torch.bfloat16), cache[..., :1].expand(64, 16, 8, 256).contiguous(),
                      cache[..., :1].expand(64, 16, 8, 256).contiguous(), tables[0], 5, 0.1, scale, scale)
    (name, grid, block, args), = loader.calls
    assert name == "prefill_paged_fp8::attn_prefill_paged_fp8"
    assert grid == (8, 19 * 4 // 4) and block == (128,) and args["start_pos"] == 5  # 4 rows per CTA at d=256


def test_cuda_ops_reject_unsupported_head_dim():
    import torch

    from metrale_cli.kernels.cuda_ops import CudaOps

    ops = CudaOps(RecordingLoader())
    cache = torch.zeros(4, 16, 2, 96, dtype=torch.bfloat16)
    with pytest.raises(MetraleError, match="head_dim"):
        ops.paged_decode(torch.zeros(1, 4, 96, dtype=torch.bfloat16), cache, cache,
                         torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1, None, None)


def test_launch_checks_arguments_before_touching_cupy():
    import torch

    from metrale_cli.kernels.cuda_ops import RMS_NORM
    from metrale_cli.kernels.loader import KernelLoader

    spec, sig = RMS_NORM
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(MetraleError, match="CUDA device"):
        KernelLoader().launch(spec, sig, (2,), (128,), x, x, x, 8, 1e-6)
    assert [kind for _, kind in sig.params] == ["bf16*", "bf16*", "bf16*", "i32", "f32"]
