"""The kernel registry: logical module name -> CUDA source file + defines, and what it exports.

A kernel is named ``module::function`` (:class:`KernelSpec`). A module is a logical name, not a
file: one templated source backs many modules through ``-D`` defines. Every paged-attention
module is ``paged_decode.cu`` or ``prefill_paged.cu`` compiled with its K / V side types
(``K_SIDE``, ``V_SIDE``), the suffix of its entry points (``KV_SUFFIX``) and its largest head_dim
(``ATTN_MAX_D``); each KV dtype's row (``kv/dtypes.KV_DTYPES``) says which of them it gets. Everything that
compiles, loads or checks a kernel resolves it through :func:`module_for`, so :data:`MODULES` is
the single source of truth; a test walks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import HEAD_DIMS, KvCacheDtype, kv_pair


def _kernels_dir() -> Path:
    """The repository's kernels_cu/ in a checkout, else the copy shipped inside the package."""
    checkout = Path(__file__).resolve().parents[2] / "kernels_cu"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parents[1] / "kernels_cu"


KERNELS_DIR = _kernels_dir()
INCLUDE_DIR = KERNELS_DIR / "include"
ARCH = "sm_90"  # the H200
TC_HEAD_DIMS = (64, 128)  # the tensor-core decode's (paged_decode_tc.cu)
TC_WIDE_HEAD_DIMS = (256,)  # the same source built for longer heads (TC_HEAD_MAX: two warps a tile)
GDN_HEAD_K_DIMS = (16, 32, 64, 128)  # the Gated DeltaNet decode's key head dims (gdn.cu)


def tc_module(head_dim: int) -> str | None:
    """The tensor-core decode's module at ``head_dim``, or None where it has none."""
    if head_dim in TC_HEAD_DIMS:
        return "paged_decode_tc"
    return "paged_decode_tc_wide" if head_dim in TC_WIDE_HEAD_DIMS else None


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


def _dims(max_d: int) -> tuple[int, ...]:
    return tuple(d for d in HEAD_DIMS if d <= max_d)


def _attention(name: str, source: str, d: KvCacheDtype, suffix: str, functions, max_d: int) -> KernelModule:
    k, v = kv_pair(d)
    defines = (("K_SIDE", k.value), ("V_SIDE", v.value), ("KV_SUFFIX", suffix), ("ATTN_MAX_D", str(max_d)),
               ("ATTN_MIN_CTAS", "1"))
    return KernelModule(name, source, defines, functions, head_dims=_dims(max_d))


def _kv_modules(d: KvCacheDtype) -> list[KernelModule]:
    """The paged-attention modules of one dtype's row: its chunked prefill and paged decodes."""
    row, sfx = d.row, d.suffix
    prefill = row.prefill
    mods = [_attention(f"prefill_paged{sfx}", "prefill_paged.cu", d, sfx + prefill.tile,
                       (f"attn_prefill_paged{sfx}{prefill.tile}",), prefill.max_head_dim)]
    decode_fns = (f"paged_decode_attn{sfx}", f"paged_decode_combine{sfx}")
    mods += [_attention(f"paged_decode{sfx}{name}", "paged_decode.cu", d, sfx, decode_fns, max_d)
             for name, max_d in row.decode]
    return mods


def _writes(module: str) -> tuple[str, ...]:
    return tuple(f"reshape_and_cache_flash{d.suffix}" for d in KvCacheDtype if d.row.write.module == module)


_TENSOR_CORE = tuple(d for d in KvCacheDtype if d.row.tensor_core is not None)
_TC_FUNCTIONS = (tuple(f"paged_decode_attn_tc{d.suffix}" for d in _TENSOR_CORE)
                 + tuple(f"paged_decode_rope_tc{p}{d.suffix}" for d in _TENSOR_CORE if d.row.tensor_core.one_launch
                         for p in ("", "_preload")))
# the batch-1 pair entries (two tiles a pass): head_dim 64 / 128 only
_TC_PAIR_FUNCTIONS = tuple(f"paged_decode_attn_tc_pair{d.suffix}" for d in _TENSOR_CORE if d.row.tensor_core.pair)

MODULES: dict[str, KernelModule] = {
    m.name: m
    for m in (
        KernelModule("rmsnorm", "rmsnorm.cu", (), ("rms_norm_bf16", "add_rms_norm_bf16")),
        KernelModule("rope", "rope.cu", (), ("rope_neox_bf16",)),
        KernelModule("activation", "activation.cu", (), ("silu_and_mul_bf16",)),
        # Batch-1 decode GEMVs fused with the norm before them or the residual add after them.
        KernelModule("gemv", "gemv.cu", (), ("gemv_norm_bf16", "gemv_norm_logits_bf16", "gemv_norm_swiglu_bf16",
                                             "gemv_add_bf16", "gemv_gate_add_bf16")),
        # Projections of 2-16 rows (decode steps of a batch) from a ring of tensor-map copies.
        KernelModule("gemm_rows", "gemm_rows.cu", (), ("gemm_rows_bf16_t1_s4", "gemm_rows_bf16_t2_s4",
                                                       "gemm_rows_bf16_t2_s6", "gemm_rows_swiglu_bf16")),
        # Tensor-parallel ranks' one-shot sums and gathers over each other's mapped buffers.
        KernelModule("all_reduce", "all_reduce.cu", (), ("one_shot_sum_bf16", "one_shot_gather_f32")),
        # The end of a decode step: greedy tokens and the next step's inputs, on the device.
        KernelModule("decode_step", "decode_step.cu", (), ("decode_advance",)),
        # The routed experts of a MoE FFN for a few rows: routing, gate/up, down + the weighted sum;
        # for a prefill chunk the routing and the weighted sum around torch's grouped GEMMs.
        KernelModule("moe", "moe.cu", (), ("moe_route_bf16", "moe_router_bf16", "moe_gate_up_bf16",
                                           "moe_gate_up_one_bf16", "moe_down_bf16",
                                           "moe_down_one_bf16", "moe_route_rows_bf16", "moe_combine_bf16")),
        # A Gated DeltaNet mixer's decode step: conv, the gated delta rule and the gated norm.
        KernelModule("gdn", "gdn.cu", (), ("gdn_decode_bf16", "gdn_decode_one_bf16"), head_dims=GDN_HEAD_K_DIMS),
        # A Gated DeltaNet prefill: the conv, the rule's inputs, every chunk's own part, the walk over
        # the chunks (the outputs are two batched GEMMs) and the gated norm.
        KernelModule("gdn_prefill", "gdn_prefill.cu", (), ("gdn_chunk_walk_f32", "gdn_chunk_prep_f32",
                                                           "gdn_chunk_inputs_bf16", "gdn_conv_bf16",
                                                           "gdn_gated_norm_bf16")),
        KernelModule("wht_bf16", "wht_bf16.cu", (), ("wht_bf16_inplace", "wht_bf16_inplace_inv"),
                     EXACT, HEAD_DIMS),
        KernelModule("reshape_and_cache", "reshape_and_cache.cu", (), _writes("reshape_and_cache"), EXACT),
        KernelModule("reshape_and_cache_turbo", "reshape_and_cache_turbo.cu", (), _writes("reshape_and_cache_turbo"),
                     EXACT, HEAD_DIMS),
        # QK-norm + RoPE + cache write fused, one entry per KV dtype (exact cache bytes).
        KernelModule("rope_and_cache", "rope_and_cache.cu", (),
                     tuple(f"rope_and_cache_{d.value}" for d in KvCacheDtype), EXACT, HEAD_DIMS),
        # Tensor-core decode of every KV dtype (head_dim 64 and 128, groups of up to 16), and the
        # bf16 / fp8 caches' whole decode attention in one launch (QK-norm, RoPE, write, combine);
        # the same kernels for head_dim 256 (two warps a tile).
        KernelModule("paged_decode_tc", "paged_decode_tc.cu", (), _TC_FUNCTIONS + _TC_PAIR_FUNCTIONS,
                     head_dims=TC_HEAD_DIMS),
        KernelModule("paged_decode_tc_wide", "paged_decode_tc.cu", (("TC_HEAD_MAX", str(max(TC_WIDE_HEAD_DIMS))),),
                     _TC_FUNCTIONS, head_dims=TC_WIDE_HEAD_DIMS),
        *(m for d in KvCacheDtype for m in _kv_modules(d)),
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
