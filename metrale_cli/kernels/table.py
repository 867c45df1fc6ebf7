"""The cuda backend's kernel table: every kernel the layers launch, its signature and launch
constants, by KV dtype and head_dim. No torch and no CuPy here: ``validate-kernels`` and the
start-up check resolve kernels from this table alone; ``cuda_ops.CudaOps`` launches them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.registry import KernelSpec, module_for
from metrale_cli.kernels.requirements import REQUIREMENTS, WHT_KERNELS
from metrale_cli.kv.dtypes import KvCacheDtype, SideType, is_wht_rotated, kv_pair

if TYPE_CHECKING:
    from metrale_cli.kernels.ops import SidePool


@dataclass(frozen=True)
class Signature:
    """A kernel's parameters, e.g. ``Signature.parse("x: bf16*, out: bf16*, n: i32, eps: f32")``.

    Pointer types end in ``*`` (``bf16*``, ``fp8*``, ``f32*``, ``i32*``, ``i64*``, ``u8*`` for packed
    KV pools); a trailing ``?``
    (``f32*?``) accepts None for an unused pointer. Scalars are ``i32`` or ``f32``.
    """

    params: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, text: str) -> Signature:
        pairs = [p.split(":") for p in text.split(",")]
        return cls(tuple((n.strip(), t.strip()) for n, t in pairs))



ATTN_THREADS = 128
MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 32
DECODE_CTAS_PER_SM = 3  # decode attention CTAs resident per SM (about 155 registers x 128 threads)
WHT_ROWS_PER_CTA = 4
# Prefill chunks of at least this many query tokens run torch SDPA (tensor cores) over the
# context gathered to bf16; shorter ones (speculative verify, a few tokens) run the paged kernel.
# The kernel reads the paged cache once and its CUDA-core work grows with tokens x context; the
# SDPA path first copies (and dequantizes) the whole context in several torch launches, a fixed
# cost that only pays off once the chunk fills at least one 16-row tensor-core tile.
SDPA_MIN_TOKENS = 16

K = KernelSpec.parse
RMS_NORM = K("rmsnorm::rms_norm_bf16"), Signature.parse(
    "x: bf16*, weight: bf16*, out: bf16*, hidden: i32, eps: f32"
)
ADD_RMS_NORM = K("rmsnorm::add_rms_norm_bf16"), Signature.parse(
    "x: bf16*, residual: bf16*, weight: bf16*, out: bf16*, sum_out: bf16*, hidden: i32, eps: f32"
)
ROPE = K("rope::rope_neox_bf16"), Signature.parse(
    "q: bf16*, k: bf16*, positions: i32*, cos: f32*, sin: f32*, hq: i32, hk: i32, head_dim: i32, rot_dim: i32"
)
SILU_AND_MUL = K("activation::silu_and_mul_bf16"), Signature.parse("gate_up: bf16*, out: bf16*, inter: i32")
_GEMV_NORM = (
    "w: bf16*, x: bf16*, residual: bf16*?, gamma: bf16*, sum_out: bf16*?, out: bf16*, n: i32, k: i32, eps: f32"
)
GEMV_NORM = K("gemv::gemv_norm_bf16"), Signature.parse(_GEMV_NORM)
GEMV_NORM_SWIGLU = K("gemv::gemv_norm_swiglu_bf16"), Signature.parse(_GEMV_NORM)
GEMV_NORM_LOGITS = K("gemv::gemv_norm_logits_bf16"), Signature.parse(
    "w: bf16*, x: bf16*, residual: bf16*?, gamma: bf16*, sum_out: bf16*?, out: f32*, n: i32, k: i32, eps: f32"
)
GEMV_ADD = K("gemv::gemv_add_bf16"), Signature.parse("w: bf16*, x: bf16*, residual: bf16*, out: bf16*, n: i32, k: i32")
DECODE_ADVANCE = K("decode_step::decode_advance"), Signature.parse(
    "logits: f32*?, vocab: i32, next_tokens: i64*, tokens: i64*, positions: i32*, seq_lens: i32*, slots: i32*, "
    "live: i32*, tables: i32*, max_blocks: i32, keys: i64*, counters: i32*"
)
STEP_THREADS = 256  # decode_step.cu's CTA
# Logits per CTA of decode_advance (up to STEP_MAX_SLICES CTAs per row): 75 CTAs for Qwen3's
# 151,936-token vocabulary.
STEP_SLICE = 2048
GEMV_THREADS = 256  # gemv.cu's CTA
GEMV_CTAS_PER_SM = 2  # its __launch_bounds__ minimum; the grid is this many CTAs per SM
GEMV_MAX_K = 16384  # its shared-memory row of x
DECODE_STACK = K("decode_stack::decode_stack_bf16"), Signature.parse(
    "layers: i64*, num_layers: i32, h: bf16*, words: i64*, part_o: f32*, part_ml: f32*, sync: i32*, block_table: i32*, seq_lens: i32*, slot_mapping: i32*, positions: i32*, cos: f32*, sin: f32*, "
    "hidden: i32, hq: i32, hk: i32, head_dim: i32, rot_dim: i32, inter: i32, num_splits: i32, eps: f32, scale: f32"
)
# decode_stack.cu's constants: its CTA, weight ring stage, widest GEMV row and shared memory
STACK_BLOCK = 288  # eight consumer warps and the weight producer's
STACK_STAGE_BYTES = 32768
STACK_MAX_K = 12288
STACK_MIN_ROWS = 4  # rows (gate/up pairs) per ring stage the planner asks of every projection
STACK_MAX_LAYERS = 128
STACK_MAX_OWN = 256  # rows of the hidden state one CTA owns
STACK_SMEM_BYTES = (5 * STACK_STAGE_BYTES + 33280 + 8 * 128 * 2 + 128 * 2 + 8 * 128 * 2 + STACK_MAX_LAYERS * 4 * 8
                    + STACK_MAX_OWN * 2 + 2 * 5 * 8 + 16)
STACK_HEAD_DIMS = (64, 128)
# Launched by every layer (decode_advance: by every decode step) whatever the KV dtype.
COMMON_KERNELS = tuple(k[0] for k in (RMS_NORM, ADD_RMS_NORM, ROPE, SILU_AND_MUL, GEMV_NORM, GEMV_NORM_LOGITS,
                                      GEMV_NORM_SWIGLU, GEMV_ADD, DECODE_ADVANCE))
_WHT_SIG = Signature.parse("x: bf16*, signs: f32*, rows: i32, head_dim: i32")
WHT = {False: (WHT_KERNELS[0], _WHT_SIG), True: (WHT_KERNELS[1], _WHT_SIG)}  # by `inverse`

# Pointer type of a pool's data: element sides by element, packed sides as bytes.
POOL_POINTER = {SideType.BF16: "bf16*", SideType.FP8: "fp8*"}

_ROPE_AND_CACHE = (
    "q: bf16*, k: bf16*, v: bf16*, q_out: bf16*, k_cache: {k}, v_cache: {v}, slot_mapping: i32*, "
    "positions: i32*, cos: f32*, sin: f32*, q_norm: bf16*?, k_norm: bf16*?, k_scale: f32*, v_scale: f32*, "
    "k_signs: f32*?, v_signs: f32*?, channel_scale: f32*?, q_stride: i32, k_stride: i32, v_stride: i32, "
    "hq: i32, hk: i32, head_dim: i32, rot_dim: i32, eps: f32"
)
ROPE_AND_CACHE_WARPS = 2  # a CTA: K and V of one KV head, or two query heads (rope_and_cache.cu)
_POINTERS = {d: tuple(POOL_POINTER.get(s, "u8*") for s in kv_pair(d)) for d in KvCacheDtype}
ROPE_AND_CACHE = {  # by KV dtype
    d: (K(f"rope_and_cache::rope_and_cache_{d.value}"), Signature.parse(_ROPE_AND_CACHE.format(k=k, v=v)))
    for d, (k, v) in _POINTERS.items()
}

_DECODE = (
    "q: bf16*, k_cache: {k}, v_cache: {v}, block_tables: i32*, seq_lens: i32*, out: bf16*, "
    "part_o: f32*?, part_ml: f32*?, k_scale: f32*, v_scale: f32*, scale: f32, hq: i32, hk: i32, "
    "head_dim: i32, max_blocks: i32, num_splits: i32"
)
_PREFILL = (
    "q: bf16*, k_cache: {k}, v_cache: {v}, block_table: i32*, out: bf16*, k_scale: f32*, "
    "v_scale: f32*, scale: f32, tokens: i32, start_pos: i32, hq: i32, hk: i32, head_dim: i32"
)
_COMBINE = "part_o: f32*, part_ml: f32*, seq_lens: i32*, out: bf16*, hq: i32, head_dim: i32, num_splits: i32"
_WRITE_HEAD = "k: bf16*, v: bf16*, k_cache: {k}, v_cache: {v}, slot_mapping: i32*"
_WRITE_TAIL = ", hk: i32, head_dim: i32"


@dataclass(frozen=True)
class WriteLaunch:
    """A cache-write kernel's extra parameters and grid: per token (block 128) or per
    (token, KV head) with a warp per side (block 64)."""

    params: str
    per_head: bool


_WRITES: dict[KvCacheDtype, WriteLaunch] = {
    KvCacheDtype.BF16: WriteLaunch("", False),
    KvCacheDtype.FP8: WriteLaunch(", k_scale: f32*, v_scale: f32*", False),
    KvCacheDtype.NVFP4: WriteLaunch("", True),
}
_TURBO_WRITE = WriteLaunch(
    ", k_scale: f32*, v_scale: f32*, k_signs: f32*?, v_signs: f32*?, channel_scale: f32*?", True
)
_BY_SIDES: dict[tuple[SideType, SideType], KvCacheDtype] = {kv_pair(d): d for d in KvCacheDtype}

Kernel = tuple[KernelSpec, Signature]


@dataclass(frozen=True)
class KvKernels:
    """The kernels serving one KV dtype at one head_dim."""

    write: Kernel
    write_per_head: bool
    decode: Kernel
    combine: Kernel
    prefill: Kernel
    rotated: bool  # some side is WHT-rotated: the layer launches the WHT bookends
    decode_tc: Kernel | None = None  # tensor-core decode (bf16 / fp8 at head_dim 64, 128)
    decode_rope: Kernel | None = None  # QK-norm + RoPE + write + tensor-core decode + combine (bf16 / fp8)

    def specs(self) -> list[KernelSpec]:
        wht = list(WHT_KERNELS) if self.rotated else []
        tc = [k[0] for k in (self.decode_tc, self.decode_rope) if k]
        return [self.write[0], self.decode[0], *tc, self.combine[0], self.prefill[0], *wht]


def _suffix(d: KvCacheDtype) -> str:
    return "" if d == KvCacheDtype.BF16 else f"_{d.value}"


def _serves(spec: KernelSpec, head_dim: int) -> bool:
    module = module_for(spec)
    return module is None or module.head_dims is None or head_dim in module.head_dims


TC_HEAD_DIMS = (64, 128)
TC_ROWS = 8  # query heads per CTA of the tensor-core decode (TC_ROWS in paged_decode_tc.cu)
# The tensor-core decodes' splits hold at least a 16-key tile for each of a CTA's 4 warps: at
# batch 1 and a 640-token context, Qwen3-8B / 0.6B decode at 231.1 / 1226.0 tok/s with it against
# 227.7 / 1180.9 with CUDA-core decode's 32 keys (an H200): fewer, fuller CTAs, fewer partials.
TC_MIN_KEYS_PER_SPLIT = 64
TC_CTAS_PER_SM = {KvCacheDtype.BF16: 4, KvCacheDtype.FP8: 3}  # its __launch_bounds__ minimums
# The tensor-core decodes (and their combine) launched programmatically: bf16's, memory-bound,
# gains 1% at batch 1; fp8's, bound by instruction issue, loses 4% at batch 16 and 32k context
# (1050 vs 1094 tok/s on an H200), so it launches normally.
TC_PROGRAMMATIC = frozenset({KvCacheDtype.BF16})
_TC_DECODE = {
    KvCacheDtype.BF16: (KernelSpec("paged_decode_tc", "paged_decode_attn_tc"), Signature.parse(_DECODE.format(k="bf16*", v="bf16*"))),
    KvCacheDtype.FP8: (KernelSpec("paged_decode_tc", "paged_decode_attn_tc_fp8"), Signature.parse(_DECODE.format(k="fp8*", v="fp8*"))),
}
"""paged_decode_tc.cu: the bf16 and fp8 caches' decode at head_dim 64 / 128 (other dtypes and sizes run
paged_decode_attn<suffix>)."""
_DECODE_ROPE = (
    "q: bf16*, k: bf16*, v: bf16*, k_cache: {p}, v_cache: {p}, slot_mapping: i32*, positions: i32*, "
    "cos: f32*, sin: f32*, q_norm: bf16*?, k_norm: bf16*?, block_tables: i32*, seq_lens: i32*, out: bf16*, "
    "part_o: f32*?, part_ml: f32*?, counters: i32*, k_scale: f32*, v_scale: f32*, scale: f32, q_stride: i32, "
    "k_stride: i32, v_stride: i32, hq: i32, hk: i32, head_dim: i32, rot_dim: i32, max_blocks: i32, "
    "num_splits: i32, eps: f32"
)
DECODE_ROPE_TC = {
    d: (KernelSpec("paged_decode_tc", f"paged_decode_rope_tc{_sfx}"), Signature.parse(_DECODE_ROPE.format(p=f"{p}*")))
    for d, _sfx, p in ((KvCacheDtype.BF16, "", "bf16"), (KvCacheDtype.FP8, "_fp8", "fp8"))
}
"""A decode step's attention in one launch: rope_and_cache_<dtype>, the tensor-core decode and its combine
fused (paged_decode_tc.cu), for one token per sequence."""


@functools.lru_cache(maxsize=None)
def kv_kernels(d: KvCacheDtype, head_dim: int) -> KvKernels:
    """Write, decode (its ``_128`` module when KV_DTYPES.md says so), split combine and chunked
    prefill of dtype ``d``; raises when a kernel does not serve ``head_dim``."""
    row, sfx = REQUIREMENTS[d], _suffix(d)
    k, v = (POOL_POINTER.get(s, "u8*") for s in kv_pair(d))
    write = _WRITES.get(d, _TURBO_WRITE)
    decode = row.decode(head_dim)
    prefill = row.prefill or KernelSpec(f"prefill_paged{sfx}", f"attn_prefill_paged{sfx}")
    unserved = [str(s) for s in (row.cache_write, decode, prefill) if not _serves(s, head_dim)]
    if unserved:
        raise MetraleError(
            f"kv-cache-dtype {d.value}: kernel(s) {', '.join(unserved)} do not serve head_dim {head_dim}",
            hint="use another --kv-cache-dtype or --backend torch for this model",
        )
    return KvKernels(
        write=(row.cache_write, Signature.parse(_WRITE_HEAD.format(k=k, v=v) + write.params + _WRITE_TAIL)),
        write_per_head=write.per_head,
        decode=(decode, Signature.parse(_DECODE.format(k=k, v=v))),
        combine=(KernelSpec(decode.module, f"paged_decode_combine{sfx}"), Signature.parse(_COMBINE)),
        prefill=(prefill, Signature.parse(_PREFILL.format(k=k, v=v))),
        rotated=any(is_wht_rotated(s) for s in kv_pair(d)),
        decode_tc=_TC_DECODE[d] if d in _TC_DECODE and head_dim in TC_HEAD_DIMS else None,
        decode_rope=DECODE_ROPE_TC[d] if d in DECODE_ROPE_TC and head_dim in TC_HEAD_DIMS else None,
    )


def dtype_of(k_pool: SidePool, v_pool: SidePool) -> KvCacheDtype:
    """The KV dtype whose (K side, V side) the two pools are."""
    sides = (k_pool.side, v_pool.side)
    if sides not in _BY_SIDES:
        raise MetraleError(f"no KV-cache dtype stores K as {sides[0].value} and V as {sides[1].value}",
                           hint="the 16 dtypes of --kv-cache-dtype are the supported pairs")
    return _BY_SIDES[sides]


def rows_per_cta(head_dim: int) -> int:
    """Mirror of ``RowsPerCta<D>`` in paged_attention.cuh (chunked prefill's query tile)."""
    return 8 if head_dim <= 128 else 4 if head_dim <= 256 else 2


def decode_rows(head_dim: int, group: int) -> int:
    """Mirror of paged_decode.cu's rule: query heads per decode CTA."""
    if head_dim <= 128:
        return 2 if group <= 2 else 4
    return rows_per_cta(head_dim)



def layer_kernels(kv_dtype, head_dim: int, stack: bool = False) -> list[KernelSpec]:
    """Every kernel ``CudaOps`` launches for a layer of this KV dtype (norms, RoPE, SwiGLU, the
    decode GEMVs, the dtype's write / decode / split combine / prefill / tensor-core decode and
    one-launch decode attention, the WHT bookends of a rotated side, the fused QK-norm + RoPE +
    write, and with ``stack`` (METRALE_DECODE_STACK) for a
    bf16 cache the whole-stack decode step): the start-up check loads them all before any weight
    is read."""
    from metrale_cli.kernels.requirements import as_kv_dtype

    specs = list(COMMON_KERNELS)
    d = as_kv_dtype(kv_dtype)
    whole = [DECODE_STACK[0]] if stack and d == KvCacheDtype.BF16 and head_dim in STACK_HEAD_DIMS else []
    return specs + kv_kernels(d, head_dim).specs() + whole + [ROPE_AND_CACHE[d][0]]
