"""The library behind ``metrale validate-kernels``: is every kernel a dtype needs here and right?

Without a GPU each kernel is compiled to an sm_90 cubin (compile.py) and its symbol looked up;
the numeric column says "skipped (no GPU)". On a GPU each kernel is loaded through CuPy and run
against its torch reference on small odd shapes. Nothing is printed here: the CLI renders the
:class:`ValidationReport`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.compile import check_module
from metrale_cli.kernels.registry import KernelSpec, module_for
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.requirements import as_kv_dtype, required_kernels

CORE_KERNELS = tuple(
    KernelSpec.parse(n)
    for n in ("rmsnorm::rms_norm_bf16", "rmsnorm::add_rms_norm_bf16", "rope::rope_neox_bf16",
              "activation::silu_and_mul_bf16")
)
SKIPPED = "skipped (no GPU)"


@dataclass(frozen=True)
class KernelRow:
    kernel: str
    compiled: str
    symbol: str
    numeric: str
    ok: bool


@dataclass(frozen=True)
class ValidationReport:
    dtype: str
    head_dim: int
    on_gpu: bool
    rows: tuple[KernelRow, ...]
    total_seconds: float
    cold_compile_seconds: float

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)


Progress = Callable[[str, int, int], None]  # (kernel, index, total)


def kernels_to_validate(dtype, head_dim: int) -> list[KernelSpec]:
    """The dtype-independent kernels of the cuda backend, the dtype's required KV kernels
    (KV_DTYPES.md), then the attention kernels the layers also launch for sides this build
    stores (split-decode combine, chunked prefill)."""
    from metrale_cli.kernels.cuda_ops import HEAD_DIMS, KV_KERNELS
    from metrale_cli.kv.dtypes import kv_pair
    from metrale_cli.kv.paged import STORAGE_DTYPES

    if head_dim not in HEAD_DIMS:
        raise MetraleError(f"the attention kernels are built for head_dim {', '.join(map(str, HEAD_DIMS))}; "
                           f"not {head_dim}", hint="use --backend torch for such a model")
    specs = list(CORE_KERNELS) + required_kernels(dtype, head_dim)
    for side in kv_pair(as_kv_dtype(dtype)):
        if side in STORAGE_DTYPES:
            kv = KV_KERNELS[STORAGE_DTYPES[side]]
            specs += [kv.cache_write[0], kv.decode[0], kv.combine[0], kv.prefill[0]]
    return list(dict.fromkeys(specs))


def validate_kernels(dtype, head_dim: int = 128, progress: Progress | None = None,
                     on_gpu: bool | None = None) -> ValidationReport:
    """Check every kernel ``dtype`` needs at ``head_dim``; numerically too when on a GPU."""
    gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    specs = kernels_to_validate(dtype, head_dim)
    start, cold = time.perf_counter(), 0.0
    rows = []
    checker = _GpuChecker(head_dim) if gpu else None
    for i, spec in enumerate(specs):
        if progress:
            progress(str(spec), i, len(specs))
        row, seconds = checker.row(spec) if checker else _cpu_row(spec)
        rows.append(row)
        cold += seconds
    if checker:
        cold = sum(e.seconds for e in checker.ops.loader.events if e.cold)
    name = getattr(dtype, "value", dtype)
    return ValidationReport(name, head_dim, gpu, tuple(rows), time.perf_counter() - start, cold)


def _missing(spec: KernelSpec) -> KernelRow:
    return KernelRow(str(spec), "missing (not in this build)", "-", "-", False)


def _cpu_row(spec: KernelSpec) -> tuple[KernelRow, float]:
    module = module_for(spec)
    if module is None:
        return _missing(spec), 0.0
    result = check_module(module)
    if not result.ok:
        last = (result.log.splitlines() or ["?"])[-1]
        return KernelRow(str(spec), f"failed: {last}", "-", "-", False), result.seconds
    how = "cached" if result.cached else f"{result.seconds:.2f} s"
    exported = spec.function in result.symbols
    symbol = "exported" if exported else "not exported"
    return KernelRow(str(spec), f"yes ({result.compiler}, {how})", symbol, SKIPPED, exported), result.seconds


class _GpuChecker:
    def __init__(self, head_dim: int):
        from metrale_cli.kernels.cuda_ops import CudaOps

        self.ops, self.head_dim = CudaOps(), head_dim

    def row(self, spec: KernelSpec) -> tuple[KernelRow, float]:
        if module_for(spec) is None:
            return _missing(spec), 0.0
        try:
            self.ops.loader.function(spec, torch.device("cuda", torch.cuda.current_device()))
        except Exception as exc:  # noqa: BLE001 - reported in the table, not raised
            return KernelRow(str(spec), f"failed: {exc}".splitlines()[0], "-", "-", False), 0.0
        check = NUMERIC_CHECKS.get(str(spec))
        problem = check(self.ops, self.head_dim) if check else "no numeric check"
        numeric = "matches reference" if problem is None else problem
        return KernelRow(str(spec), "yes (CuPy)", "exported", numeric, problem is None), 0.0


def compare(out: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> str | None:
    """None when |out - want| <= atol + rtol·|want| everywhere, else the worst error."""
    err = (out.float() - want.float()).abs()
    bad = err > atol + rtol * want.float().abs()
    if not bool(bad.any()):
        return None
    return f"max |err| {err.max().item():.3g} at {int(bad.sum())} of {err.numel()} elements"


def make_paged_case(seq_lens, hq: int, hk: int, head_dim: int, kv_dtype: torch.dtype,
                    spare_blocks: int = 3, seed: int = 0, device="cuda"):
    """Random q and paged K/V caches with shuffled block tables: a dict of tensors."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + 15) // 16 for n in seq_lens]
    width, total = max(need + [1]) + spare_blocks, sum(need) + spare_blocks
    ids = torch.randperm(total, generator=g).to(torch.int32)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = ids[at : at + n]
        at += n
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.03])
    kv = [torch.randn(total, 16, hk, head_dim, generator=g) for _ in range(2)]
    if kv_dtype == torch.float8_e4m3fn:
        kv = [ref.quantize_fp8(x * 8 * s, s) for x, s in zip(kv, (k_scale, v_scale))]
    else:
        kv = [x.to(kv_dtype) for x in kv]
    case = dict(k_cache=kv[0], v_cache=kv[1], block_tables=tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), k_scale=k_scale, v_scale=v_scale)
    return {k: t.to(device) for k, t in case.items()}


def _randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).cuda()


def _check_rms(ops, _hd):
    x, w = _randn(7, 200), _randn(200, seed=2)
    return compare(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), 1e-2, 8e-3)


def _check_add_rms(ops, _hd):
    x, r, w = _randn(7, 200), _randn(7, 200, seed=3), _randn(200, seed=2)
    (o, s), (ro, rs) = ops.add_rms_norm(x, r, w, 1e-6), ref.add_rms_norm(x, r, w, 1e-6)
    return compare(s, rs, 0, 0) or compare(o, ro, 1e-2, 8e-3)


def _check_rope(ops, hd):
    q, k = _randn(19, 4, hd), _randn(19, 2, hd, seed=4)
    pos = torch.randint(0, 64, (19,), dtype=torch.int32).cuda()
    ang = torch.arange(64)[:, None] * 0.01 ** (torch.arange(hd // 4) / (hd // 4))
    cos, sin = ang.cos().cuda(), ang.sin().cuda()  # rot_dim = hd // 2: a partial rotation
    want = ref.rope(q.clone(), k.clone(), pos, cos, sin)
    got = ops.rope(q.clone(), k.clone(), pos, cos, sin)
    return compare(got[0], want[0], 0, 0) or compare(got[1], want[1], 0, 0)


def _check_silu(ops, _hd):
    gu = _randn(7, 2 * 99) * 3
    return compare(ops.silu_and_mul(gu), ref.silu_and_mul(gu), 1e-3, 8e-3)


def _check_write(kv_dtype):
    def check(ops, hd):
        c = make_paged_case([40], 4, 2, hd, kv_dtype)
        k, v = _randn(19, 2, hd) * 4, _randn(19, 2, hd, seed=5) * 4
        slots = torch.randperm(48)[:19].to(torch.int32).cuda()
        slots[3] = -1
        mine = [c["k_cache"].clone(), c["v_cache"].clone()]
        ops.reshape_and_cache(k, v, *mine, slots, c["k_scale"], c["v_scale"])
        ref.reshape_and_cache(k, v, c["k_cache"], c["v_cache"], slots, c["k_scale"], c["v_scale"])
        as_bits = (lambda t: t.view(torch.uint8)) if kv_dtype == torch.float8_e4m3fn else (lambda t: t)
        return compare(as_bits(mine[0]), as_bits(c["k_cache"]), 0, 0) or compare(
            as_bits(mine[1]), as_bits(c["v_cache"]), 0, 0)
    return check


def _check_decode(kv_dtype):
    def check(ops, hd):
        c = make_paged_case([1, 19, 599], 8, 2, hd, kv_dtype)
        q = _randn(3, 8, hd)
        args = (c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], hd**-0.5,
                c["k_scale"], c["v_scale"])
        return compare(ops.paged_decode(q, *args), ref.paged_decode(q, *args), 2e-2, 2e-2)
    return check


def _check_prefill(kv_dtype):
    def check(ops, hd):
        c = make_paged_case([99], 8, 2, hd, kv_dtype)
        q = _randn(19, 8, hd)
        args = (c["k_cache"], c["v_cache"], c["block_tables"][0], 80, hd**-0.5, c["k_scale"], c["v_scale"])
        return compare(ops.paged_prefill(q, *args), ref.paged_prefill(q, *args), 2e-2, 2e-2)
    return check


FP8 = torch.float8_e4m3fn
NUMERIC_CHECKS: dict[str, Callable] = {
    "rmsnorm::rms_norm_bf16": _check_rms,
    "rmsnorm::add_rms_norm_bf16": _check_add_rms,
    "rope::rope_neox_bf16": _check_rope,
    "activation::silu_and_mul_bf16": _check_silu,
    "reshape_and_cache::reshape_and_cache_flash": _check_write(torch.bfloat16),
    "reshape_and_cache::reshape_and_cache_flash_fp8": _check_write(FP8),
    "paged_decode::paged_decode_attn": _check_decode(torch.bfloat16),
    "paged_decode_fp8::paged_decode_attn_fp8": _check_decode(FP8),
    # the decode check's 599-token context on a 6-CTA grid runs split, so it covers the combine
    "paged_decode::paged_decode_combine": _check_decode(torch.bfloat16),
    "paged_decode_fp8::paged_decode_combine_fp8": _check_decode(FP8),
    "prefill_paged::attn_prefill_paged": _check_prefill(torch.bfloat16),
    "prefill_paged_fp8::attn_prefill_paged_fp8": _check_prefill(FP8),
}
