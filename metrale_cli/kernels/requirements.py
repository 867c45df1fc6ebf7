"""The start-up check: every kernel a KV-cache dtype needs exists, compiles and serves the head_dim.

The kernels are KV_DTYPES.md's table, derived from each dtype's row
(:meth:`~metrale_cli.kernels.kv_kernels.KvKernels.required`). A kernel that this build does not
ship, that does not compile, or whose module is not instantiated for the head_dim is reported,
never stubbed: :func:`validate_required_kv_kernels` names every one of them in a single error
before any weight is loaded.
"""

from __future__ import annotations

from collections.abc import Callable

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.kv_kernels import kv_kernels, required_kernels
from metrale_cli.kernels.registry import KernelSpec, module_for
from metrale_cli.kv.dtypes import KvCacheDtype, concrete, is_experimental

KernelCheck = Callable[[KernelSpec], "str | None"]
"""A check of one kernel: None when it is usable, else the reason it is not."""


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


def _head_dim(head_dim: int) -> int:
    if head_dim <= 0:
        raise MetraleError(f"head_dim must be positive, got {head_dim}")
    return head_dim


def kernel_problems(dtype: KvCacheDtype | str, head_dim: int, checker: KernelCheck | None = None) -> dict[str, str]:
    """{``module::function``: reason} for every required kernel that is not usable: ``checker``'s
    reason (default: it compiles), else a head_dim it does not serve."""
    d, check = concrete(dtype), checker or compile_check
    unserved = kv_kernels(d, _head_dim(head_dim)).unserved()
    problems = {str(k): check(k) or unserved.get(str(k)) for k in required_kernels(d, head_dim)}
    return {name: reason for name, reason in problems.items() if reason is not None}


def missing_kernels(dtype: KvCacheDtype | str, head_dim: int, checker: KernelCheck | None = None) -> list[str]:
    """Every required kernel that is not usable (all of them, not the first), as ``m::f``."""
    return list(kernel_problems(dtype, head_dim, checker))


def missing_message(d: KvCacheDtype, head_dim: int, names) -> str:
    """The one line that names every missing kernel of ``d`` at ``head_dim``."""
    note = f" ({d.value} is experimental)" if is_experimental(d) else ""
    return (f"kv-cache-dtype {d.value} (head_dim {head_dim}) requires kernel(s) missing from this build: "
            f"{', '.join(names)}{note}")


def validate_required_kv_kernels(dtype: KvCacheDtype | str, head_dim: int,
                                 checker: KernelCheck | None = None) -> list[KernelSpec]:
    """Raise one :class:`MetraleError` naming every missing kernel; else return the kernels."""
    d = concrete(dtype)
    problems = kernel_problems(d, head_dim, checker)
    if not problems:
        return required_kernels(d, head_dim)
    reasons = "; ".join(sorted(set(problems.values())))
    raise MetraleError(
        missing_message(d, head_dim, problems),
        hint=f"{reasons}; `metrale validate-kernels --kv-cache-dtype {d.value} --head-dim {head_dim}` "
        "checks each kernel",
    )
