"""Which kernels each KV-cache dtype needs, and the start-up check that they exist.

:data:`REQUIREMENTS` is the table of KV_DTYPES.md, one row per dtype (a test walks every
:class:`KvCacheDtype`). A WHT-rotated side adds the Hadamard bookends. A kernel that this build
does not ship, that does not compile, or whose module is not instantiated for the head_dim is
reported, never stubbed: :func:`validate_required_kv_kernels` names every one of them in a
single error before any weight is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import KvCacheDtype, is_experimental, is_wht_rotated, kv_pair, parse_kv_cache_dtype
from metrale_cli.kernels.registry import KernelSpec, module_for

KernelCheck = Callable[[KernelSpec], "str | None"]
"""A check of one kernel: None when it is usable, else the reason it is not."""

WHT_KERNELS = (KernelSpec("wht_bf16", "wht_bf16_inplace"), KernelSpec("wht_bf16", "wht_bf16_inplace_inv"))


@dataclass(frozen=True)
class KvRequirement:
    """One row of the table: cache write, paged decode (with its ``_128`` module), prefill."""

    cache_write: KernelSpec
    decode_function: str
    decode_module: str
    decode_module_128: str | None  # used instead when head_dim <= 128
    prefill: KernelSpec | None

    def decode(self, head_dim: int) -> KernelSpec:
        small = self.decode_module_128 is not None and head_dim <= 128
        return KernelSpec(self.decode_module_128 if small else self.decode_module, self.decode_function)


def _plain(kind: str) -> KvRequirement:
    suffix = "" if kind == "bf16" else f"_{kind}"
    return KvRequirement(
        KernelSpec("reshape_and_cache", f"reshape_and_cache_flash{suffix}"),
        f"paged_decode_attn{suffix}", f"paged_decode{suffix}", None, None,
    )


def _turbo(name: str, always_128: bool = False, prefill_tile: str = "_64") -> KvRequirement:
    return KvRequirement(
        KernelSpec("reshape_and_cache_turbo", f"reshape_and_cache_flash_{name}"),
        f"paged_decode_attn_{name}",
        f"paged_decode_{name}_128" if always_128 else f"paged_decode_{name}",
        None if always_128 else f"paged_decode_{name}_128",
        KernelSpec(f"prefill_paged_{name}", f"attn_prefill_paged_{name}{prefill_tile}"),
    )


D = KvCacheDtype
REQUIREMENTS: dict[KvCacheDtype, KvRequirement] = {
    D.BF16: _plain("bf16"),
    D.FP8: _plain("fp8"),
    D.NVFP4: _plain("nvfp4"),
    D.TURBO4: _turbo("turbo4"),
    D.TURBO3: _turbo("turbo3"),
    D.TURBO2: _turbo("turbo2", always_128=True, prefill_tile=""),
    D.TURBO8: _turbo("turbo8"),
    D.TURBO4K_TURBO3V: _turbo("turbo4k_turbo3v", always_128=True),
    D.TURBO4K_TURBO8V: _turbo("turbo4k_turbo8v", always_128=True),
    D.TURBO3K_TURBO8V: _turbo("turbo3k_turbo8v", always_128=True),
    D.BF16K_TURBO4V: _turbo("bf16k_turbo4v"),
    D.BF16K_TURBO3V: _turbo("bf16k_turbo3v"),
    D.BF16K_TURBO2V: _turbo("bf16k_turbo2v"),
    D.FP8K_TURBO4V: _turbo("fp8k_turbo4v"),
    D.FP8K_TURBO3V: _turbo("fp8k_turbo3v"),
    D.FP8K_TURBO2V: _turbo("fp8k_turbo2v"),
}


def as_kv_dtype(dtype: KvCacheDtype | str) -> KvCacheDtype:
    """A parsed dtype (aliases accepted); `auto` is refused: requirements need a concrete one."""
    parsed = parse_kv_cache_dtype(dtype) if isinstance(dtype, str) else dtype
    if not isinstance(parsed, KvCacheDtype):
        raise MetraleError("kernel requirements need a concrete kv-cache-dtype, not 'auto'")
    return parsed


def required_kernels(dtype: KvCacheDtype | str, head_dim: int) -> list[KernelSpec]:
    """Every kernel ``dtype`` needs at ``head_dim``: write, decode, prefill, WHT bookends."""
    d = as_kv_dtype(dtype)
    if head_dim <= 0:
        raise MetraleError(f"head_dim must be positive, got {head_dim}")
    row = REQUIREMENTS[d]
    kernels = [row.cache_write, row.decode(head_dim)] + ([row.prefill] if row.prefill else [])
    if any(is_wht_rotated(side) for side in kv_pair(d)):
        kernels += WHT_KERNELS
    return kernels


def compile_check(spec: KernelSpec) -> str | None:
    """Present in the registry, compiles to an sm_90 cubin, and the cubin exports it."""
    from metrale_cli.kernels.compile import check_module

    module = module_for(spec)
    if module is None:
        return "not in this build"
    result = check_module(module)
    if not result.ok:
        return "does not compile: " + (result.log.splitlines() or ["no log"])[-1]
    if spec.function not in result.symbols:
        return f"module {module.name} compiles but does not export it"
    return None


def head_dim_problem(spec: KernelSpec, head_dim: int) -> str | None:
    """Why the module of ``spec`` cannot serve ``head_dim`` (its instantiated sizes), or None."""
    module = module_for(spec)
    if module is None or module.head_dims is None or head_dim in module.head_dims:
        return None
    return f"built for head_dim {'/'.join(map(str, module.head_dims))} only"


def kernel_problems(dtype, head_dim: int, checker: KernelCheck | None = None) -> dict[str, str]:
    """{``module::function``: reason} for every required kernel that is not usable."""
    check = checker or compile_check
    problems = {str(k): check(k) or head_dim_problem(k, head_dim) for k in required_kernels(dtype, head_dim)}
    return {name: reason for name, reason in problems.items() if reason is not None}


def missing_kernels(dtype, head_dim: int, checker: KernelCheck | None = None) -> list[str]:
    """Every required kernel that is not usable (all of them, not the first), as ``m::f``."""
    return list(kernel_problems(dtype, head_dim, checker))


def validate_required_kv_kernels(
    dtype, head_dim: int, checker: KernelCheck | None = None
) -> list[KernelSpec]:
    """Raise one :class:`MetraleError` naming every missing kernel; else return the kernels."""
    d = as_kv_dtype(dtype)
    problems = kernel_problems(d, head_dim, checker)
    if not problems:
        return required_kernels(d, head_dim)
    note = f" ({d.value} is experimental)" if is_experimental(d) else ""
    reasons = "; ".join(sorted({f"{reason}" for reason in problems.values()}))
    raise MetraleError(
        f"kv-cache-dtype {d.value} (head_dim {head_dim}) requires kernel(s) missing from this "
        f"build: {', '.join(problems)}{note}",
        hint=f"{reasons}; `metrale validate-kernels --kv-cache-dtype {d.value} --head-dim {head_dim}` "
        "checks each kernel",
    )
