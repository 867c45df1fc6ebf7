"""The kernel contract every backend implements.

Two backends implement :class:`Ops`: ``TorchOps`` (``kernels/reference.py``, plain torch, the
oracle) and ``CudaOps`` (``kernels/cuda_ops.py``, CuPy-compiled kernels from ``kernels_cu/``).
The model picks one at build time and never per call. Dense GEMMs and embeddings are not part of
the contract: both backends use torch (cuBLAS on a GPU) for them.

Shapes below use T = tokens, B = sequences, Hq / Hk = query / KV heads, D = head_dim,
NB = blocks in the pool, MB = blocks in a block table. Activations are bf16 (or the model dtype);
``positions``, ``slot_mapping``, ``block_tables`` and ``seq_lens`` are int32 on the activations'
device. Every tensor of a side pool lives on that device too, so a CUDA graph can
capture it (online fp8 calibration rewrites ``scale`` in place).

The cache of one layer is a :class:`~metrale_cli.kv.pool.LayerKv`: its dtype and two side pools,
K and V, each with its own side type (``kv/dtypes.py``). Their byte layouts are normative in
``docs/kv-formats.md`` and defined by the torch codecs of ``kv/quant.py``. Slot ``s`` is block
``s // 16``, offset ``s % 16``; a negative slot is skipped. The attention over the cache is a
:class:`PagedAttention`, which a layer gets once for its dtype and head_dim
(:meth:`Ops.paged_attention`): the kernels are chosen then, never per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.kv.pool import LayerKv

STEP_MAX_SLICES = 128  # decode_step.cu: CTAs per row of logits, at most


@dataclass
class StepBuffers:
    """The static inputs of a decode step, a row per sequence (``engine/cuda_graphs.py``), and
    :meth:`Ops.decode_advance`'s scratch. All on one device; B rows, MB blocks per table."""

    next_tokens: torch.Tensor  # (B,) int64: the tokens sampled last, the next step's inputs
    tokens: torch.Tensor  # (B,) int64: this step's input tokens
    positions: torch.Tensor  # (B,) int32
    seq_lens: torch.Tensor  # (B,) int32: context lengths, the new token included
    slots: torch.Tensor  # (B,) int32: the new token's cache slot, -1 for no write
    live: torch.Tensor  # (B,) int32: 1 for a running sequence, 0 for padding or a finished row
    tables: torch.Tensor  # (B, MB) int32 block tables
    keys: torch.Tensor  # (B, STEP_MAX_SLICES) int64 scratch of the CUDA kernel
    counters: torch.Tensor  # (B,) int32 zeros, left zero by every launch

    @classmethod
    def zeros(cls, rows: int, max_blocks: int, device) -> StepBuffers:
        """Padding rows: not live, slot -1, context length 1, block 0."""
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.long, device=device)
        return cls(torch.zeros(rows, **i64), torch.zeros(rows, **i64), torch.zeros(rows, **i32),
                   torch.ones(rows, **i32), torch.full((rows,), -1, **i32), torch.zeros(rows, **i32),
                   torch.zeros(rows, max_blocks, **i32), torch.zeros(rows, STEP_MAX_SLICES, **i64),
                   torch.zeros(rows, **i32))


@dataclass
class GdnTensors:
    """One Gated DeltaNet layer's mixer as :meth:`Ops.gdn_decode` / :meth:`Ops.gdn_prefill` take
    it: its parameters and its share of the recurrent-state pool (S sequences + a scratch slot).
    Hk key heads of Dk, Hv value heads of Dv; C = conv channels = 2*Hk*Dk + Hv*Dv."""

    conv: torch.Tensor  # (C, K) the depthwise conv's taps, model dtype
    a_log: torch.Tensor  # (Hv,) float32
    dt_bias: torch.Tensor  # (Hv,) float32
    norm: torch.Tensor  # (Dv,) the gated norm's weight, model dtype
    eps: float
    num_k_heads: int
    conv_pool: torch.Tensor  # (S+1, K, C) float32: entry p % K of a slot holds the input at position p
    recurrent_pool: torch.Tensor  # (S+1, Hv, Dk, Dv) float32


@dataclass
class MoeRoute:
    """A router's choice for T rows (:meth:`Ops.moe_norm_route`): ``ids`` (T, top_k) int32 and
    ``weights`` (T, top_k) fp32 as :meth:`Ops.moe_route` gives them, and the backend's own form of
    it for :meth:`Ops.moe_routed` (the cuda backend's plan or per-expert counts; None for torch)."""

    ids: torch.Tensor
    weights: torch.Tensor
    plan: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    gate: torch.Tensor | None = None  # (T, 1): a shared expert's gate logits, where it runs apart


@dataclass(frozen=True)
class SharedExpert:
    """A MoE's shared expert handed to its routed experts' call (:meth:`Ops.moe`), to run as
    :meth:`chunks` more experts of the routed width I after the routed ones: ``gate_up`` (2W, H)
    = [gate; up], ``down`` (H, W); chunk c is its width's [cI, cI + I), the last one zero-padded
    (zero rows and columns add exact zeros)."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def width(self) -> int:
        return self.down.shape[1]

    def chunks(self, inter: int) -> int:
        return -(-self.width // inter)

    def term(self, ops: Ops, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Run apart, in HF's order: sigmoid(gate) * down(silu(gate_up x)), ``gate`` (T, 1) the
        gate's logits."""
        return torch.sigmoid(gate) * F.linear(ops.silu_and_mul(F.linear(x, self.gate_up)), self.down)


class Ops(Protocol):
    name: str
    # Whether a MoE FFN hands this backend its shared expert as chunk experts beside the routed
    # ones (``shared`` slots of :meth:`moe_route`) rather than running it apart: the cuda backend,
    # where that saves the shared expert's own launches; torch keeps HF's order of operations.
    moe_folds_shared: bool

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: (T, H), weight: (H,) -> (T, H) in x's dtype. HF convention: w * (x·rsqrt(mean x²+eps))."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused residual add: s = x + residual (rounded to x's dtype) -> (rms_norm(s), s)."""

    def rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style (rotate-half) RoPE on the first ``rot_dim`` dims of each head.

        q: (T, Hq, D), k: (T, Hk, D), positions: (T,) int32, cos/sin: (max_pos, rot_dim // 2)
        float32 tables. May work in place; callers use the returned tensors.
        """

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: (T, 2I) = [gate | up] -> silu(gate) * up: (T, I)."""

    def moe_route(self, logits: torch.Tensor, top_k: int, normalize: bool,
                  shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A MoE router's choice, as HF transformers makes it: logits (T, E) -> (ids (T, top_k)
        int32, weights (T, top_k) float32): softmax over the E experts in fp32, the top_k largest
        in descending order, divided by their sum when ``normalize``. Among equal probabilities
        the lower expert id is taken first, as torch.topk does on CUDA; the torch backend is
        torch.topk itself (HF's call, whose tie order on the CPU is its own).

        With ``shared`` > 0 a shared expert rides along as ``shared`` chunk experts after the E
        routed ones (:class:`SharedExpert`): logits (T, E + 1) end with its gate's, and every row
        gets the slots top_k .. top_k + shared - 1 = experts E .. E + shared - 1, each weighted
        sigmoid(gate) (ids and weights (T, top_k + shared))."""

    def moe(self, x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
            normalize: bool, residual: torch.Tensor | None, experts_read: torch.Tensor | None,
            shared: SharedExpert | None = None) -> torch.Tensor:
        """The routed experts of a MoE FFN: x (T, H), logits (T, E) (the router's, in x's dtype),
        gate_up (E, 2I, H) = [gate; up], down (E, H, I) -> (T, H) in x's dtype:
        [residual +] sum over the row's :meth:`moe_route` choice of weight * down_e(silu(gate_e x) *
        up_e x), the weight rounded to x's dtype first (HF). ``experts_read`` ((1,) int64), when
        given, grows by the number of distinct experts the call read, on the device. With a
        ``shared`` expert the logits end with its gate's and its chunks join every row's choice
        (:meth:`moe_route`'s ``shared`` slots); ``experts_read`` counts the routed experts alone."""

    def moe_norm_route(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, router: torch.Tensor,
                       top_k: int, normalize: bool, experts_read: torch.Tensor | None,
                       shared: int = 0) -> tuple[torch.Tensor, MoeRoute]:
        """What comes before a MoE FFN's experts: x = :meth:`rms_norm` (h), the router's logits
        ``F.linear(x, router)`` (router (E, H), or (E + 1, H) ending with the shared expert's gate
        when ``shared`` chunk slots are asked for) and their :meth:`moe_route` -> (x, the route).
        ``experts_read`` grows as in :meth:`moe`. The cuda backend runs a row in one launch, its
        router GEMV in gemv_norm_bf16's summation order rather than cuBLAS's."""

    def moe_routed(self, x: torch.Tensor, route: MoeRoute, gate_up: torch.Tensor, down: torch.Tensor,
                   residual: torch.Tensor | None, shared: SharedExpert | None = None) -> torch.Tensor:
        """:meth:`moe`'s experts over a route of :meth:`moe_norm_route`'s (with its shared slots,
        the ``shared`` expert whose chunks they are)."""

    def gdn_decode(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                   layer: GdnTensors, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode token per row through a Gated DeltaNet mixer, between its in- and
        out-projections: mixed (B, C) = [q; k; v] (the in-projection's), z (B, Hv*Dv), b / a (B, Hv),
        all in the model dtype; row i continues slot ``slots[i]`` (int32, the scratch slot for a
        padding row) at position ``positions[i]`` (int32). Causal conv over the slot's window and
        SiLU (rounded to the model dtype), L2-normalised q / k with q scaled by Dk ** -0.5, key heads
        repeated to the value heads, g = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b), the
        gated delta rule over the slot's fp32 state, then HF's gated RMSNorm with z -> (B, Hv*Dv)
        in the model dtype; the slot's conv entry and state are updated in place. No host sync
        (``kernels/gdn_reference.py: decode`` is the oracle)."""

    def gdn_prefill(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                    layer: GdnTensors, slot: int, start_pos: int) -> torch.Tensor:
        """:meth:`gdn_decode` for T tokens of one sequence at positions start_pos .. start_pos+T-1:
        mixed (T, C) ... -> (T, Hv*Dv), the rule in its chunked form (``gdn_reference.prefill``)."""

    def paged_attention(self, dtype: KvCacheDtype, head_dim: int) -> PagedAttention:
        """The paged-cache attention of one KV dtype at one head_dim, its kernels resolved now (a
        layer asks once, at build time). Raises MetraleError when this backend cannot serve it."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: x (T, K), weight (N, K) -> (T, N), the layers' projections
        of more than one row (a decode step of a batch, a prefill chunk). The cuda backend runs up to
        16 bf16 rows in its own kernel (its sums in another order than cuBLAS's: the same values to
        within bf16 rounding), more through cuBLAS."""

    def linear_silu_and_mul(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu_and_mul(linear(x, gate_up))``: x (T, K), gate_up (2I, K) = [gate; up] -> (T, I), a
        dense FFN's first half. The cuda backend runs up to 16 bf16 rows in one launch (the same
        bytes as its two), more as the two."""

    def gemv_fits(self, k: int, dtype: torch.dtype) -> bool:
        """True when the fused decode GEMVs below serve an input row of ``k`` elements and weights
        of ``dtype``; the layers then run batch-1 decode through them, else through the unfused
        sequence."""

    def gemv_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One row, RMSNorm fused into the projection after it: x, residual: (1, H) (residual
        may be None), norm_weight: (H,), weight: (N, H) -> (``F.linear(rms_norm(s), weight)``:
        (1, N), s) with s = x + residual rounded to x's dtype (x itself when residual is None)."""

    def gemv_norm_logits(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        """The LM head of one row: ``gemv_norm(...)[0].float()`` -> (1, N) float32, with no copy
        launched for the widening on the cuda backend."""

    def gemv_norm_swiglu(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        gate_up: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`gemv_norm` with ``gate_up``: (2I, H) = [gate; up], followed by
        :meth:`silu_and_mul` -> ((1, I), s)."""

    def gemv_add(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                 gate: torch.Tensor | None = None) -> torch.Tensor:
        """One row, the residual add fused into the projection before it: x: (1, K),
        weight: (N, K), residual: (1, N) -> residual + F.linear(x, weight), rounded once more to
        the dtype as torch's add does; a new tensor (``F.linear(x, weight)`` alone where
        ``residual`` is None: a tensor-parallel rank's part of the sum). With ``gate`` (1, K), x is
        first ``x * torch.sigmoid(gate)`` in its dtype (a gated attention's output before o_proj)."""

    def decode_advance(self, logits: torch.Tensor | None, step: StepBuffers, rows: int) -> None:
        """The end of a decode step over the first ``rows`` rows of ``step``. With ``logits``
        (rows, vocab) fp32, ``next_tokens`` receives each row's greedy token, torch.argmax's (the
        first index of the largest value; NaN counts as the largest). Then every row takes
        ``next_tokens`` as its input token, and a live row moves on one position: position and
        context length + 1, slot the new position's place in its block table (the block index
        clamped to the table); a row not live keeps its position and gets slot -1."""

    def wht(self, x: torch.Tensor, signs: torch.Tensor, inverse: bool) -> torch.Tensor:
        """x: (N, D) bf16 rows (N = tokens * heads), rotated in place by R = S2·H·S1/√D (by Rᵀ
        when ``inverse``), computed in fp32 and rounded to bf16 once; returns x.
        signs: (2, D) fp32 (row 0 = S1, row 1 = S2)."""


class PagedAttention(Protocol):
    """The paged-cache attention of one KV dtype at one head_dim (:meth:`Ops.paged_attention`).
    Every ``kv`` it is given is a layer cache of that dtype and head_dim."""

    dtype: KvCacheDtype
    head_dim: int

    def reshape_and_cache(
        self, k: torch.Tensor, v: torch.Tensor, kv: LayerKv, slot_mapping: torch.Tensor
    ) -> None:
        """Write k, v: (T, Hk, D) bf16, in the ORIGINAL basis, at ``slot_mapping``: (T,).

        Each side stores in its own type: bf16 copy, fp8 = e4m3(x / scale), packed nvfp4, or a
        rotated side: rotate in fp32 by R (the pool's ``signs``), multiply by ``channel_scale`` (K
        only, when set) and quantize, all inside the write, exactly as docs/kv-formats.md says.
        """

    def rope_and_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKv,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        rotate_q: bool = False,
    ) -> torch.Tensor:
        """QK-norm, RoPE and the cache write in one call; returns the query.

        Exactly ``q = rms_norm(q) if q_norm``, ``k = rms_norm(k) if k_norm`` (per head, over D),
        ``q, k = rope(q, k, positions, cos, sin)``, ``reshape_and_cache(k, v, kv,
        slot_mapping)``. q: (T, Hq, D), k / v: (T, Hk, D) bf16, each head's D elements contiguous
        (strided views of a fused qkv projection are fine); q_norm / k_norm: (D,) or None;
        cos / sin as for :meth:`rope`. Returns a new contiguous (T, Hq, D) tensor holding q after
        norm and RoPE, in the original basis, or with ``rotate_q`` in the K side's basis:
        ``rotation.rotate_query(q)``'s bytes (R·q, divided by the InnerQ scales of its KV head;
        q itself for an unrotated K side). q, k and v are not modified; the normalized, rotated k
        is only written to the cache.
        """

    def paged_decode(
        self,
        q: torch.Tensor,
        kv: LayerKv,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        restore_v: bool = False,
    ) -> torch.Tensor:
        """One query token per sequence over its whole cached context.

        q: (B, Hq, D), block_tables: (B, MB), seq_lens: (B,) tokens in the cache for each
        sequence, the current one included -> (B, Hq, D) in q's dtype. GQA: query head h reads
        KV head h // (Hq // Hk). ``q`` arrives already rotated (and divided by the InnerQ scales
        of its KV head) when the K side is rotated; the output is in the rotated basis when the
        V side is rotated, or with ``restore_v`` rotated back (``rotation.restore_output``'s
        bytes). Kernels only dequantize and attend, and rotate the output back.
        """

    def rope_cache_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKv,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """A decode step's attention, one token per sequence (q: (B, Hq, D), k / v: (B, Hk, D) as
        for :meth:`rope_and_cache`): exactly ``paged_decode(rope_and_cache(q, k, v, ...,
        rotate_q=True), ..., restore_v=True)`` -> (B, Hq, D) in the original basis, the new K / V
        written. The cuda backend runs it as one launch for the bf16 and fp8 caches (head_dim 64 / 128),
        else as its rope_and_cache and paged_decode."""

    def paged_prefill(
        self,
        q: torch.Tensor,
        kv: LayerKv,
        block_table: torch.Tensor,
        start_pos: int,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of one chunk of one sequence over the cache (chunked prefill).

        q: (T, Hq, D) holds positions ``start_pos .. start_pos+T-1``, whose K/V are already in
        the cache together with every earlier position; block_table: (MB,). Query t attends to
        cache positions ``0 .. start_pos + t`` -> (T, Hq, D) in q's dtype. Rotation as in
        :meth:`paged_decode`.
        """
