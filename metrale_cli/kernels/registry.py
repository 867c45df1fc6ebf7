"""The kernel registry: logical module name -> CUDA source file + defines, and what it exports.

A kernel is named ``module::function`` (:class:`KernelSpec`). A module is a logical name, not a
file: one templated source backs several modules through ``-D`` defines (``paged_decode`` and
``paged_decode_fp8`` are one body). Everything that compiles, loads or checks a kernel resolves
it through :func:`module_for` so the table below is the single source of truth; a test walks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from metrale_cli.errors import MetraleError

def _kernels_dir() -> Path:
    """The repository's kernels_cu/ in a checkout, else the copy shipped inside the package."""
    checkout = Path(__file__).resolve().parents[2] / "kernels_cu"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parents[1] / "kernels_cu"


KERNELS_DIR = _kernels_dir()
INCLUDE_DIR = KERNELS_DIR / "include"
ARCH = "sm_90"  # the H200


@dataclass(frozen=True, order=True)
class KernelSpec:
    """One exported ``extern "C"`` entry point: ``module::function``."""

    module: str
    function: str

    @classmethod
    def parse(cls, name: str) -> KernelSpec:
        module, sep, function = name.partition("::")
        if not sep or not module or not function:
            raise MetraleError(f"kernel name '{name}' is not of the form module::function")
        return cls(module, function)

    def __str__(self) -> str:
        return f"{self.module}::{self.function}"


@dataclass(frozen=True)
class KernelModule:
    """A logical module: ``source`` (relative to kernels_cu/) compiled with ``defines``."""

    name: str
    source: str
    defines: tuple[tuple[str, str], ...]
    functions: tuple[str, ...]

    @property
    def path(self) -> Path:
        return KERNELS_DIR / self.source

    def options(self) -> tuple[str, ...]:
        """Compiler flags shared by NVRTC (CuPy or cuda-bindings) and nvcc."""
        return ("-std=c++17", f"-I{INCLUDE_DIR}") + tuple(f"-D{k}={v}" for k, v in self.defines)


_FP8 = (("KV_FP8", "1"),)

MODULES: dict[str, KernelModule] = {
    m.name: m
    for m in (
        KernelModule("rmsnorm", "rmsnorm.cu", (), ("rms_norm_bf16", "add_rms_norm_bf16")),
        KernelModule("rope", "rope.cu", (), ("rope_neox_bf16",)),
        KernelModule("activation", "activation.cu", (), ("silu_and_mul_bf16",)),
        KernelModule(
            "reshape_and_cache",
            "reshape_and_cache.cu",
            (),
            ("reshape_and_cache_flash", "reshape_and_cache_flash_fp8"),
        ),
        KernelModule(
            "paged_decode", "paged_decode.cu", (), ("paged_decode_attn", "paged_decode_combine")
        ),
        KernelModule(
            "paged_decode_fp8",
            "paged_decode.cu",
            _FP8,
            ("paged_decode_attn_fp8", "paged_decode_combine_fp8"),
        ),
        KernelModule("prefill_paged", "prefill_paged.cu", (), ("attn_prefill_paged",)),
        KernelModule("prefill_paged_fp8", "prefill_paged.cu", _FP8, ("attn_prefill_paged_fp8",)),
    )
}


def module_for(spec: KernelSpec) -> KernelModule | None:
    """The module that should export ``spec``, or None when this build has no such kernel."""
    module = MODULES.get(spec.module)
    if module is None or spec.function not in module.functions:
        return None
    return module


def all_kernels() -> list[KernelSpec]:
    """Every kernel the registry declares, module by module."""
    return [KernelSpec(m.name, f) for m in MODULES.values() for f in m.functions]
