"""The cuda backend's kernel table: the kernels every layer launches whatever its KV dtype, their
signatures, and the launch constants the host mirrors from the CUDA sources. The KV-dtype
kernels are :func:`~metrale_cli.kernels.kv_kernels.kv_kernels`'s. No torch and no CuPy here:
``validate-kernels`` and the start-up check resolve kernels from these tables alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from metrale_cli.kernels.registry import KernelSpec


@dataclass(frozen=True)
class Signature:
    """A kernel's parameters, e.g. ``Signature.parse("x: bf16*, out: bf16*, n: i32, eps: f32")``.

    Pointer types end in ``*`` (``bf16*``, ``fp8*``, ``f32*``, ``i32*``, ``i64*``, ``u8*`` for packed
    KV pools); a trailing ``?``
    (``f32*?``) accepts None for an unused pointer. Scalars are ``i32`` or ``f32``; ``tmap`` is a
    tensor map (cuda-bindings' ``CUtensorMap``) passed by value.
    """

    params: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, text: str) -> Signature:
        pairs = [p.split(":") for p in text.split(",")]
        return cls(tuple((n.strip(), t.strip()) for n, t in pairs))


Kernel = tuple[KernelSpec, Signature]

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
# kernels_cu/all_reduce.cu: tensor-parallel ranks' one-shot collectives (kernels/cuda_collectives.py)
ONE_SHOT_SUM = K("all_reduce::one_shot_sum_bf16"), Signature.parse(
    "x: bf16*, out: bf16*, data: i64*, signals: i64*, n: i32, rank: i32, ranks: i32, capacity: i32"
)
ONE_SHOT_GATHER = K("all_reduce::one_shot_gather_f32"), Signature.parse(
    "x: f32*, out: f32*, data: i64*, signals: i64*, rows: i32, cols: i32, rank: i32, ranks: i32, capacity: i32"
)
ONE_SHOT_BLOCKS, ONE_SHOT_THREADS, ONE_SHOT_MAX_RANKS = 32, 512, 8  # all_reduce.cu's AR_BLOCKS, AR_THREADS, AR_MAX_RANKS
ONE_SHOT_SIGNAL_BYTES = 4 * ONE_SHOT_BLOCKS * (ONE_SHOT_MAX_RANKS + 1)  # flags, then counters
COLLECTIVE_KERNELS = (ONE_SHOT_SUM[0], ONE_SHOT_GATHER[0])  # loaded by --all-reduce one-shot
_GEMV_NORM = (
    "w: bf16*, x: bf16*, residual: bf16*?, gamma: bf16*, sum_out: bf16*?, out: bf16*, n: i32, k: i32, eps: f32"
)
GEMV_NORM = K("gemv::gemv_norm_bf16"), Signature.parse(_GEMV_NORM)
GEMV_NORM_SWIGLU = K("gemv::gemv_norm_swiglu_bf16"), Signature.parse(_GEMV_NORM)
GEMV_NORM_LOGITS = K("gemv::gemv_norm_logits_bf16"), Signature.parse(
    "w: bf16*, x: bf16*, residual: bf16*?, gamma: bf16*, sum_out: bf16*?, out: f32*, n: i32, k: i32, eps: f32"
)
GEMV_ADD = K("gemv::gemv_add_bf16"), Signature.parse("w: bf16*, x: bf16*, residual: bf16*, out: bf16*, n: i32, k: i32")
GEMV_GATE_ADD = K("gemv::gemv_gate_add_bf16"), Signature.parse(
    "w: bf16*, x: bf16*, gate: bf16*, residual: bf16*, out: bf16*, n: i32, k: i32")
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
GEMV_MAX_K = 20480  # its shared-memory row of x (gemv.cuh)
# gemm_rows.cu: projections of up to GEMM_ROWS_MAX rows, K a multiple of GEMM_ROWS_KC, from
# tensor maps (``tmap``: a CUtensorMap by value). Its variants: (column tiles of 16 rows a CTA,
# ring stages) -> kernel.
GEMM_ROWS_MAX = 16
GEMM_ROWS_KC = 256
GEMM_ROWS_THREADS = 160  # four consumer warps and the producer's
GEMM_ROWS_SIG = Signature.parse("w_map: tmap, x_map: tmap, y: bf16*, m: i32, n: i32, k: i32")
GEMM_ROWS = {(t, s): K(f"gemm_rows::gemm_rows_bf16_t{t}_s{s}") for t, s in ((1, 4), (2, 4), (2, 6))}
# A dense FFN's gate/up and SwiGLU (w = [gate | up], y = silu(gate) * up), launched as the 2/4 variant.
GEMM_ROWS_SWIGLU = K("gemm_rows::gemm_rows_swiglu_bf16")
GEMM_ROWS_SWIGLU_VARIANT = (2, 4)
# Kernels built on sm_90 instructions (tensor-map copies, transaction barriers); on an older GPU the
# projections they serve run in cuBLAS (CudaOps.linear), so they are neither loaded nor required.
SM90_KERNELS = frozenset((*GEMM_ROWS.values(), GEMM_ROWS_SWIGLU))


def for_arch(specs, arch: str) -> list:
    """``specs`` less those a GPU of ``arch`` ("sm_89", ...) does not run (SM90_KERNELS below sm_90)."""
    major_minor = int(arch.removeprefix("sm_"))
    return [s for s in specs if major_minor >= 90 or s not in SM90_KERNELS]


SM_SHARED_BYTES = 233472  # an H100 / H200 SM's shared memory (228 KB), 1 KB of it reserved a CTA


def gemm_rows_shared(tiles: int, stages: int) -> int:
    """gemm_rows.cu's dynamic shared memory: barriers, the warps' sums, 1 KB of alignment, the ring."""
    return 128 + 4 * tiles * 1024 + 1024 + stages * 4 * (tiles * 16 + 16) * 128


def gemm_rows_variant(m: int, n: int, k: int, sms: int) -> tuple[int, int] | None:
    """The variant (column tiles of 16 rows a CTA, ring stages) for an ``m``-row projection of an
    (n, k) weight, or None where cuBLAS streams it as fast: the best of each class in the table of
    docs/performance.md (2026-12-04, 15 shapes x 2-16 rows on an H200), as a rule.

    - More than 8192 columns, or more 32-column tiles than SMs with K over 4096 (Qwen3.5-27B's
      q/k/v, gate/up, o_proj): cuBLAS, at 3.4-4.1 TB/s there.
    - Tiles of 32 columns that fill one wave, K >= 4096 (Qwen3-8B's o_proj and down): a 6-stage
      ring, one CTA an SM.
    - 8+ rows with at most half the SMs' worth of 32-column tiles, or with more 32-column tiles
      than SMs (Qwen3-30B-A3B's o_proj, Qwen3-8B's q/k/v): tiles of 16 columns, three CTAs an SM;
      with fewer rows that variant measured 10-55% slower than the 32-column ones.
    - Else tiles of 32 columns and 4 stages, two CTAs an SM, walking the tiles past one wave.
    """
    tiles = -(-n // 32)
    if n > 8192 or (tiles > sms and k > 4096):
        return None
    if tiles <= sms:
        if 10 * tiles >= 9 * sms and k >= 4096:
            return 2, 6
        return (1, 4) if m >= 8 and 2 * tiles <= sms else (2, 4)
    return (1, 4) if m >= 8 else (2, 4)


def gemm_rows_launch(n: int, sms: int, variant: tuple[int, int]) -> tuple[KernelSpec, int, int]:
    """(kernel, dynamic shared bytes, grid) of ``variant`` for ``n`` columns: a CTA a column tile
    up to the CTAs resident at once, which then walk the tiles past that."""
    tiles, stages = variant
    shared = gemm_rows_shared(tiles, stages)
    resident = sms * (SM_SHARED_BYTES // (shared + 1024))
    return GEMM_ROWS[variant], shared, min(-(-n // (16 * tiles)), resident)


# Launched by every layer (decode_advance: by every decode step) whatever the KV dtype.
COMMON_KERNELS = tuple(k[0] for k in (RMS_NORM, ADD_RMS_NORM, ROPE, SILU_AND_MUL, GEMV_NORM, GEMV_NORM_LOGITS,
                                      GEMV_NORM_SWIGLU, GEMV_ADD, GEMV_GATE_ADD, DECODE_ADVANCE)) + tuple(GEMM_ROWS.values()) \
    + (GEMM_ROWS_SWIGLU,)
# The routed experts of a MoE FFN for up to MOE_DECODE_ROWS rows (moe.cu); more rows run
# grouped GEMMs (torch._grouped_mm) between moe.cu's routing of many rows and its combine.
MOE_ROUTE = K("moe::moe_route_bf16"), Signature.parse(
    "logits: bf16*, ids: i32*, weights: f32*, plan: i32*, experts_read: i64*?, rows: i32, num_experts: i32, "
    "top_k: i32, shared: i32, normalize: i32"
)
MOE_ROUTER = K("moe::moe_router_bf16"), Signature.parse(
    "router: bf16*, h: bf16*, gamma: bf16*, x_out: bf16*, logits: bf16*, ids: i32*, weights: f32*, plan: i32*, "
    "experts_read: i64*?, num_experts: i32, hidden: i32, top_k: i32, shared: i32, normalize: i32, eps: f32"
)
MOE_GATE_UP = K("moe::moe_gate_up_bf16"), Signature.parse(
    "x: bf16*, gate_up: bf16*, shared_gate_up: bf16*?, plan: i32*, act: bf16*, hidden: i32, inter: i32, "
    "shared_width: i32, num_experts: i32, top_k: i32"
)
MOE_GATE_UP_ONE = K("moe::moe_gate_up_one_bf16"), MOE_GATE_UP[1]  # batch 1: more weight loads in flight
MOE_GATE_UP_ONE_PER_SM = 3  # its CTAs an SM: 168 registers a thread (ptxas), 128 threads
MOE_DOWN = K("moe::moe_down_bf16"), Signature.parse(
    "act: bf16*, down: bf16*, shared_down: bf16*?, plan: i32*, weights: f32*, y: f32*, residual: bf16*?, "
    "out: bf16*, counters: i32*, rows: i32, hidden: i32, inter: i32, shared_width: i32, num_experts: i32, top_k: i32"
)
MOE_DOWN_ONE = K("moe::moe_down_one_bf16"), Signature.parse(
    "act: bf16*, down: bf16*, shared_down: bf16*?, plan: i32*, weights: f32*, residual: bf16*?, out: bf16*, "
    "hidden: i32, inter: i32, shared_width: i32, num_experts: i32, top_k: i32"
)
MOE_ROUTE_ROWS = K("moe::moe_route_rows_bf16"), Signature.parse(
    "logits: bf16*, ids: i32*, weights: f32*, counts: i32*, rows: i32, num_experts: i32, top_k: i32, shared: i32, "
    "normalize: i32"
)
MOE_COMBINE = K("moe::moe_combine_bf16"), Signature.parse(
    "ys: bf16*, where: i32*, weights: f32*, residual: bf16*?, out: bf16*, hidden: i32, top_k: i32"
)
MOE_KERNELS = tuple(k[0] for k in (MOE_ROUTE, MOE_ROUTER, MOE_GATE_UP, MOE_GATE_UP_ONE, MOE_DOWN, MOE_DOWN_ONE,
                                    MOE_ROUTE_ROWS, MOE_COMBINE))
MOE_TC_THREADS = 128  # moe.cu's expert CTA: 4 warps splitting K
MOE_TC_ROWS = 16  # the weight rows (output columns) of one expert CTA
MOE_DOWN_ONE_THREADS = 1024  # moe_down_one_bf16's CTA: every slot's experts of a column tile (batch 1)
MOE_DOWN_ONE_SLOTS = 32  # the row's slots it serves
MOE_ROUTER_CLUSTER = 16  # moe_router_bf16's grid up to this many CTAs runs as one cluster
MOE_THREADS = 256  # moe.cu's prefill routing (a warp per row) and combine CTAs
MOE_WARPS = MOE_THREADS // 32
MOE_MAX_EXPERTS = 1024  # its routing CTA's
MOE_MAX_PAIRS = 1024  # rows x top_k of one routing launch
MOE_MAX_TOP_K = 32  # a lane per slot
MOE_DECODE_ROWS = 64
# A Gated DeltaNet mixer's decode step, one launch (gdn.cu): a CTA per (value head, row), 4 threads
# per state column; its key head dims are the gdn module's head_dims.
GDN_DECODE = K("gdn::gdn_decode_bf16"), Signature.parse(
    "mixed: bf16*, z: bf16*, b: bf16*, a: bf16*, conv: bf16*, a_log: f32*, dt_bias: f32*, norm: bf16*, "
    "conv_pool: f32*, state_pool: f32*, slots: i32*, positions: i32*, out: bf16*, mixed_stride: i32, z_stride: i32, "
    "b_stride: i32, a_stride: i32, num_k_heads: i32, num_v_heads: i32, head_k_dim: i32, head_v_dim: i32, taps: i32, "
    "eps: f32"
)
# Batch 1's: its pool reads (slot, window, state) before the PDL wait, in registers; a row whose
# block has a thread per q / k channel, up to GDN_ONE_THREADS threads and GDN_ONE_MAX_TAPS taps.
GDN_DECODE_ONE = K("gdn::gdn_decode_one_bf16"), GDN_DECODE[1]
GDN_ONE_THREADS = 512  # GDN_ONE_THREADS in gdn.cu (Dv <= 128)
GDN_ONE_MAX_TAPS = 4  # GDN_ONE_MAX_TAPS in gdn.cu
# The walk over a prefill's chunks of the chunked gated delta rule (gdn_prefill.cu): a CTA per
# (sequence x head, GDN_WALK_COLS state columns).
GDN_CHUNK_WALK = K("gdn_prefill::gdn_chunk_walk_f32"), Signature.parse(
    "w: f32*, u: f32*, k_tail: f32*, gamma: f32*, state: f32*, starts: f32*, chunks: i32, head_k_dim: i32, "
    "head_v_dim: i32"
)
# Every chunk's own part of the chunked rule before the walk (w, u, k_tail, gamma, the
# intra-chunk scores; q scaled in place), a CTA per chunk and (sequence x head) (gdn_prefill.cu).
GDN_CHUNK_PREP = K("gdn_prefill::gdn_chunk_prep_f32"), Signature.parse(
    "q: f32*, k: f32*, v: f32*, g: f32*, beta: f32*, w: f32*, u: f32*, k_tail: f32*, gamma: f32*, scores: f32*, "
    "chunks: i32, head_k_dim: i32, head_v_dim: i32"
)
# The chunked rule's inputs of one sequence in the walk's layout, one pass (gdn_prefill.cu).
GDN_CHUNK_INPUTS = K("gdn_prefill::gdn_chunk_inputs_bf16"), Signature.parse(
    "conv: bf16*, b: bf16*, a: bf16*, a_log: f32*, dt_bias: f32*, q: f32*, k: f32*, v: f32*, g: f32*, beta: f32*, "
    "tokens: i32, conv_stride: i32, b_stride: i32, a_stride: i32, num_k_heads: i32, num_v_heads: i32, head_k_dim: i32, "
    "head_v_dim: i32"
)
# A prefill's causal conv + SiLU over the slot's window, and the gated norm after the rule
# (gdn_prefill.cu).
GDN_CONV = K("gdn_prefill::gdn_conv_bf16"), Signature.parse(
    "mixed: bf16*, weight: bf16*, window: f32*, out: bf16*, tokens: i32, start_pos: i32, mixed_stride: i32, "
    "channels: i32, taps: i32"
)
GDN_GATED_NORM = K("gdn_prefill::gdn_gated_norm_bf16"), Signature.parse(
    "o: f32*, z: bf16*, norm: bf16*, out: bf16*, padded: i32, z_stride: i32, num_v_heads: i32, head_v_dim: i32, "
    "eps: f32"
)
GDN_WALK_THREADS = 256
GDN_WALK_COLS = 16
GDN_WALK_MAX_DK = 128
GDN_CONV_THREADS = 256  # gdn_conv_bf16's CTA: a thread per channel
GDN_CONV_TOKENS = 64  # the tokens each of its threads walks
GDN_MAX_TAPS = 8
GDN_PREP_THREADS = 256  # gdn_chunk_prep_f32's CTA
GDN_PREP_MAX_DV = 256
GDN_PREP_BLOCK = 16  # its solve's blocks


# The most shared memory one block may opt into, by architecture (the CUDA programming guide's
# table): sm_80 / sm_87 163 KB, sm_86 / sm_89 / sm_120 99 KB, sm_90 / sm_100 227 KB.
BLOCK_SHARED_OPTIN = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376, "sm_90": 232448,
                      "sm_100": 232448, "sm_120": 101376}


def gdn_prep_shared_bytes(dk: int, dv: int, chunk: int = 64) -> int:
    """gdn_chunk_prep_f32's dynamic shared memory: k rows, v-then-q rows (pitch width + 4), A and
    T (L x L), c, beta and exp(c), the solve's three block sums."""
    return 4 * (chunk * (dk + 4) + chunk * (max(dk, dv) + 4) + 2 * chunk * chunk + 3 * chunk
                + 3 * GDN_PREP_BLOCK * GDN_PREP_BLOCK)


GDN_KERNELS = (GDN_DECODE[0], GDN_DECODE_ONE[0], GDN_CHUNK_WALK[0], GDN_CHUNK_PREP[0], GDN_CHUNK_INPUTS[0],
               GDN_CONV[0], GDN_GATED_NORM[0])
GDN_MAX_DV = 256  # GDN_MAX_DV in gdn.cu
GDN_SPLIT = 4  # gdn.cu's threads per state column (GDN_SPLIT)


def gdn_threads(head_v_dim: int) -> int:
    """gdn_decode_bf16's CTA: GDN_SPLIT threads per state column (a warp: 8 columns), rounded up
    to whole warps: 1024 at GDN_MAX_DV."""
    return 32 * -(-GDN_SPLIT * head_v_dim // 32)


WHT_SIG = Signature.parse("x: bf16*, signs: f32*, rows: i32, head_dim: i32")


def rows_per_cta(head_dim: int) -> int:
    """Mirror of ``RowsPerCta<D>`` in paged_attention.cuh (chunked prefill's query tile)."""
    return 8 if head_dim <= 128 else 4 if head_dim <= 256 else 2


def decode_rows(head_dim: int, group: int) -> int:
    """Mirror of paged_decode.cu's rule: query heads per decode CTA."""
    if head_dim <= 128:
        return 2 if group <= 2 else 4
    return rows_per_cta(head_dim)


ROPE_AND_CACHE_WARPS = 2  # a CTA: K and V of one KV head, or two query heads (rope_and_cache.cu)
TC_ROWS = 8  # query heads per CTA of the tensor-core decode (TC_ROWS in paged_decode_tc.cu)
# The tensor-core decodes' splits hold at least a 16-key tile for each of a CTA's 4 warps: at
# batch 1 and a 640-token context, Qwen3-8B / 0.6B decode at 231.1 / 1226.0 tok/s with it against
# 227.7 / 1180.9 with CUDA-core decode's 32 keys (an H200): fewer, fuller CTAs, fewer partials.
TC_MIN_KEYS_PER_SPLIT = 64
TC_MAX_CLUSTER = 16  # the most splits the one-launch decode combines in a cluster (paged_decode_tc.cu)
TC_MAX_SPLITS = 64  # the most splits a tensor-core decode combines in its launch (split_combine.cuh)
TC_PAIR_CTAS_PER_SM = 2  # the batch-1 pair entries' __launch_bounds__ minimum (TC_PAIR_CTAS)
# Batch 1's one-launch decode takes its _preload entry (each warp's first tile loaded before the PDL
# wait) where a KV head has at most this many query heads and a warp holds a whole head (head_dim
# <= 128): Qwen3-0.6B (2 a KV head) measured 2.6% faster on an H100 and 1.6% on an H200; 4 and 8 were
# 0.1-0.5 µs a layer slower on an H100 (docs/performance.md, 2026-12-05, 8989300 to 9d6084f).
TC_PRELOAD_MAX_GROUP = 2
# Past TC_FEW_SPLITS splits a tensor-core decode's split holds at least TC_LONG_KEYS_PER_SPLIT keys
# (16 tiles, 4 a warp): more, shorter splits cost more in the combine than their warps gain. Batch 1
# on an H200 (qwen3-8b, docs/performance.md): at a 4k context 16 splits beat 60 (bf16) or 32
# (packed) by 1-3%; at 32k, 60 beat 32 by 2.6% (bf16).
TC_FEW_SPLITS = 16
TC_LONG_KEYS_PER_SPLIT = 256
