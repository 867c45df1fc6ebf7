"""The kernel registry: logical module name -> CUDA source file + defines, and what it exports.

A kernel is named ``module::function`` (:class:`KernelSpec`). A module is a logical name, not a
file: one templated source backs many modules through ``-D`` defines. Every paged-attention
module is ``paged_decode.cu`` or ``prefill_paged.cu`` compiled with its K / V side types
(``K_SIDE``, ``V_SIDE``), the suffix of its entry points (``KV_SUFFIX``) and its largest head_dim
(``ATTN_MAX_D``); :data:`KV_BUILD` says which of them each KV dtype gets. Everything that
compiles, loads or checks a kernel resolves it through :func:`module_for`, so :data:`MODULES` is
the single source of truth; a test walks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import KvCacheDtype, kv_pair


def _kernels_dir() -> Path:
    """The repository's kernels_cu/ in a checkout, else the copy shipped inside the package."""
    checkout = Path(__file__).resolve().parents[2] / "kernels_cu"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parents[1] / "kernels_cu"


KERNELS_DIR = _kernels_dir()
INCLUDE_DIR = KERNELS_DIR / "include"
ARCH = "sm_90"  # the H200
ALL_HEAD_DIMS = (64, 128, 256, 512)


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
    """A logical module: ``source`` (relative to kernels_cu/) compiled with ``defines`` and
    ``flags``. ``head_dims``: the head dims its kernels serve (None: any, they take a size)."""

    name: str
    source: str
    defines: tuple[tuple[str, str], ...]
    functions: tuple[str, ...]
    flags: tuple[str, ...] = ()
    head_dims: tuple[int, ...] | None = None

    @property
    def path(self) -> Path:
        return KERNELS_DIR / self.source

    def options(self) -> tuple[str, ...]:
        """Compiler flags shared by NVRTC (CuPy or cuda-bindings) and nvcc."""
        return ("-std=c++17", f"-I{INCLUDE_DIR}", *self.flags) + tuple(f"-D{k}={v}" for k, v in self.defines)


# Modules that store bytes which must equal the torch codecs' bit for bit: no FMA contraction.
EXACT = ("--fmad=false",)

D = KvCacheDtype


@dataclass(frozen=True)
class KvBuild:
    """The attention modules one KV dtype gets (names as in KV_DTYPES.md's table)."""

    decode_128: bool  # paged_decode_<d>_128: head_dim 64 / 128 / 256
    decode: bool  # paged_decode_<d>: head_dim 64 .. 512
    prefill_tile: str  # prefill_paged_<d>::attn_prefill_paged_<d><tile>: "_64" or ""


KV_BUILD: dict[KvCacheDtype, KvBuild] = {
    D.NVFP4: KvBuild(False, True, ""),
    D.TURBO4: KvBuild(True, True, "_64"),
    D.TURBO3: KvBuild(True, True, "_64"),
    D.TURBO8: KvBuild(True, True, "_64"),
    D.TURBO2: KvBuild(True, False, ""),
    D.TURBO4K_TURBO3V: KvBuild(True, False, "_64"),
    D.TURBO4K_TURBO8V: KvBuild(True, False, "_64"),
    D.TURBO3K_TURBO8V: KvBuild(True, False, "_64"),
    D.BF16K_TURBO4V: KvBuild(True, True, "_64"),
    D.BF16K_TURBO3V: KvBuild(True, True, "_64"),
    D.BF16K_TURBO2V: KvBuild(True, True, "_64"),
    D.FP8K_TURBO4V: KvBuild(True, True, "_64"),
    D.FP8K_TURBO3V: KvBuild(True, True, "_64"),
    D.FP8K_TURBO2V: KvBuild(True, True, "_64"),
}
"""Every dtype but bf16 / fp8 (whose modules predate the side types and keep their names)."""

TURBO_WRITES = tuple(d for d in KV_BUILD if d != D.NVFP4)
"""The dtypes whose cache write is ``reshape_and_cache_turbo::reshape_and_cache_flash_<d>``."""


def _dims(max_d: int) -> tuple[int, ...]:
    return tuple(d for d in ALL_HEAD_DIMS if d <= max_d)


def _attention(name: str, source: str, sides, suffix: str, functions, max_d: int) -> KernelModule:
    k, v = sides
    defines = (("K_SIDE", k), ("V_SIDE", v), ("KV_SUFFIX", suffix), ("ATTN_MAX_D", str(max_d)),
               ("ATTN_MIN_CTAS", "1"))
    return KernelModule(name, source, defines, functions, head_dims=_dims(max_d))


def _kv_modules(d: KvCacheDtype, build: KvBuild) -> list[KernelModule]:
    sides, sfx = tuple(s.value for s in kv_pair(d)), f"_{d.value}"
    decode_fns = (f"paged_decode_attn{sfx}", f"paged_decode_combine{sfx}")
    mods = [_attention(f"prefill_paged{sfx}", "prefill_paged.cu", sides, sfx + build.prefill_tile,
                       (f"attn_prefill_paged{sfx}{build.prefill_tile}",), 512)]
    if build.decode_128:
        mods.append(_attention(f"paged_decode{sfx}_128", "paged_decode.cu", sides, sfx, decode_fns, 256))
    if build.decode:
        mods.append(_attention(f"paged_decode{sfx}", "paged_decode.cu", sides, sfx, decode_fns, 512))
    return mods


_FP8 = (("K_SIDE", "fp8"), ("V_SIDE", "fp8"), ("KV_SUFFIX", "_fp8"))
_LEGACY_DIMS = _dims(256)

MODULES: dict[str, KernelModule] = {
    m.name: m
    for m in (
        KernelModule("rmsnorm", "rmsnorm.cu", (), ("rms_norm_bf16", "add_rms_norm_bf16")),
        KernelModule("rope", "rope.cu", (), ("rope_neox_bf16",)),
        KernelModule("activation", "activation.cu", (), ("silu_and_mul_bf16",)),
        # Batch-1 decode GEMVs fused with the norm before them or the residual add after them.
        KernelModule("gemv", "gemv.cu", (), ("gemv_norm_bf16", "gemv_norm_logits_bf16", "gemv_norm_swiglu_bf16",
                                             "gemv_add_bf16")),
        # The end of a decode step: greedy tokens and the next step's inputs, on the device.
        KernelModule("decode_step", "decode_step.cu", (), ("decode_advance",)),
        # Batch-1 decode of a whole dense bf16 stack (bf16 KV cache) in one persistent launch.
        KernelModule("decode_stack", "decode_stack.cu", (), ("decode_stack_bf16",), head_dims=(64, 128)),
        KernelModule("wht_bf16", "wht_bf16.cu", (), ("wht_bf16_inplace", "wht_bf16_inplace_inv"),
                     EXACT, ALL_HEAD_DIMS),
        KernelModule(
            "reshape_and_cache", "reshape_and_cache.cu", (),
            ("reshape_and_cache_flash", "reshape_and_cache_flash_fp8", "reshape_and_cache_flash_nvfp4"),
            EXACT,
        ),
        KernelModule("reshape_and_cache_turbo", "reshape_and_cache_turbo.cu", (),
                     tuple(f"reshape_and_cache_flash_{d.value}" for d in TURBO_WRITES), EXACT, ALL_HEAD_DIMS),
        # QK-norm + RoPE + cache write fused, one entry per KV dtype (exact cache bytes).
        KernelModule("rope_and_cache", "rope_and_cache.cu", (),
                     tuple(f"rope_and_cache_{d.value}" for d in KvCacheDtype), EXACT, ALL_HEAD_DIMS),
        KernelModule("paged_decode", "paged_decode.cu", (), ("paged_decode_attn", "paged_decode_combine"),
                     head_dims=_LEGACY_DIMS),
        KernelModule("paged_decode_fp8", "paged_decode.cu", _FP8,
                     ("paged_decode_attn_fp8", "paged_decode_combine_fp8"), head_dims=_LEGACY_DIMS),
        # Tensor-core decode of the bf16 / fp8 caches (head_dim 64 and 128, groups of up to 16),
        # and each one's whole decode attention in one launch (QK-norm, RoPE, write, combine).
        KernelModule("paged_decode_tc", "paged_decode_tc.cu", (),
                     ("paged_decode_attn_tc", "paged_decode_attn_tc_fp8", "paged_decode_rope_tc",
                      "paged_decode_rope_tc_fp8"),
                     head_dims=(64, 128)),
        KernelModule("prefill_paged", "prefill_paged.cu", (), ("attn_prefill_paged",), head_dims=_LEGACY_DIMS),
        KernelModule("prefill_paged_fp8", "prefill_paged.cu", _FP8, ("attn_prefill_paged_fp8",),
                     head_dims=_LEGACY_DIMS),
        *(m for d, build in KV_BUILD.items() for m in _kv_modules(d, build)),
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
