"""Qwen3AttentionLayer: the full-attention transformer layer (the seed engine's name and role).

RMSNorm (fused with the residual add) -> fused q/k/v projection -> optional QK-norm -> RoPE ->
KV-cache write (these three one launch once calibration has frozen) -> paged attention ->
(optional output gate: out * sigmoid(gate), Qwen3-Next) -> o_proj -> residual add + the pre-FFN
norm -> FFN component. What the layer is comes from its
:class:`~metrale_cli.layers.spec.LayerSpec` (heads, head_dim, RoPE, scale, QK-norm, KV dtype);
the attention kernels of its KV dtype and head_dim are resolved once, when it is built
(``Ops.paged_attention``). Batch-1 decode on a backend whose fused GEMVs serve the layer
(``Ops.gemv_fits``) runs each projection as one launch with its neighbour: norm + q/k/v,
o_proj + residual add, and the FFN's own (``FfnComponent.add_row``); the layer then hands on the
running sum alone (``residual`` None). WHT bookends: when the layer's K side is stored rotated,
Q is rotated the same way (and divided by the InnerQ channel scales) before attention, so scores
are unchanged; when the V side is rotated, the attention output comes back in the rotated basis
and is rotated back (kernels/rotation.py). Once calibration has frozen the backend does both
(rope_and_cache's ``rotate_q``, paged_decode's ``restore_v``, or rope_cache_decode, which does
both): on the cuda backend they ride in the cache-write launch and the split combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import Ops
from metrale_cli.kernels.rotation import restore_output, rotate_query
from metrale_cli.kv.calibration import KvCalibration
from metrale_cli.kv.pool import LayerKv
from metrale_cli.layers.context import ForwardContext
from metrale_cli.layers.protocols import FfnComponent
from metrale_cli.layers.spec import LayerSpec
from metrale_cli.layers.parallel import SINGLE, TensorParallel


@dataclass
class AttentionWeights:
    qkv: torch.Tensor  # (Hq*D + 2*Hk*D, hidden) = [q; k; v], then [gate] (Hq*D rows) with an output gate
    o: torch.Tensor  # (hidden, Hq*D)
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # (D,)
    k_norm: torch.Tensor | None = None


@dataclass
class AttnLayerState:
    """Per-sequence state of a full-attention layer: empty, its K/V live in the paged cache."""


class Qwen3AttentionLayer:
    """A :class:`~metrale_cli.layers.protocols.Layer`: pre-norm full attention over the paged
    cache ``kv``, then the pre-norm FFN component ``ffn``. As a tensor-parallel shard (``tp``) it
    holds some heads (and their KV): o_proj's output is summed over the ranks (at batch 1 with
    the residual that rank 0 alone adds in the fused GEMV)."""

    def __init__(self, spec: LayerSpec, weights: AttentionWeights, input_norm: torch.Tensor,
                 ffn_norm: torch.Tensor, ffn: FfnComponent, ops: Ops, kv: LayerKv,
                 rope: tuple[torch.Tensor, torch.Tensor], calibration: KvCalibration, tp: TensorParallel = SINGLE):
        a = spec.attention
        if (kv.dtype, kv.head_dim, kv.num_kv_heads) != (spec.kv_dtype, a.head_dim, a.num_kv_heads):
            raise MetraleError(f"layer {spec.index}: its KV cache is {kv.dtype.value} {kv.num_kv_heads}x{kv.head_dim}, "
                               f"its spec {spec.kv_dtype.value} {a.num_kv_heads}x{a.head_dim}")
        self.spec, self.weights, self.ffn, self.ops, self.kv = spec, weights, ffn, ops, kv
        self.input_norm, self.ffn_norm = input_norm, ffn_norm
        self.rope_cos, self.rope_sin = rope
        self.calibration, self.tp = calibration, tp
        self.idx, self.eps, self.scale = spec.index, spec.eps, a.scale
        self.attention = ops.paged_attention(spec.kv_dtype, a.head_dim)
        w = weights
        self.fused_decode = (
            ffn.fuses_row and w.qkv_bias is None and w.o_bias is None
            and all(ops.gemv_fits(t.shape[1], t.dtype) for t in (w.qkv, w.o))
        )

    # --- the layer protocol -------------------------------------------------------------
    def is_ssm_layer(self) -> bool:
        return False

    def uses_ssm_pool(self) -> bool:
        return False

    def alloc_state(self, ssm_slot: int | None = None) -> AttnLayerState:
        return AttnLayerState()

    def release_state(self, state: AttnLayerState) -> None:
        """Nothing to free: the sequence's blocks are released by the cache's owner."""

    def state_bytes(self) -> int:
        return 0

    def decode_graph_unsupported(self) -> str | None:
        """The cuda kernels read every step input from device buffers; the torch references
        gather each sequence's context with host-side lengths, which a graph would freeze."""
        if self.ops.name != "cuda":
            return f"the {self.ops.name} backend's attention reads context lengths on the host"
        return None

    def tensors(self) -> list[torch.Tensor]:
        w = self.weights
        own = [w.qkv, w.o, w.qkv_bias, w.o_bias, w.q_norm, w.k_norm, self.input_norm, self.ffn_norm]
        return [t for t in own if t is not None] + self.ffn.tensors()

    def routed_bytes(self) -> int:
        return self.ffn.routed_bytes()

    def prefill(self, hidden, residual, state: AttnLayerState, ctx: ForwardContext):
        return self._forward(hidden, residual, ctx)

    def decode_multi_seq(self, hidden, residual, states: list[AttnLayerState], ctx: ForwardContext):
        return self._forward(hidden, residual, ctx)

    def decode(self, hidden, residual, state: AttnLayerState, ctx: ForwardContext):
        return self._forward(hidden, residual, ctx)

    def decode_batched(self, hidden, residual, state: AttnLayerState, ctx: ForwardContext):
        """K tokens of one sequence in one pass: a short causal prefill."""
        return self._forward(hidden, residual, ctx)

    def frozen(self) -> bool:
        """This layer's online calibration (fp8 scales, InnerQ) is done: nothing needs the roped K
        on the host side any more."""
        return self.calibration.frozen(self.idx)

    # --- the body -------------------------------------------------------------------------
    def _forward(self, hidden, residual, ctx: ForwardContext):
        if self.fused_decode and not ctx.is_prefill and hidden.shape[0] == 1:
            return self._decode_one(hidden, residual, ctx)
        if residual is None:
            residual = hidden
            normed = self.ops.rms_norm(hidden, self.input_norm, self.eps)
        else:
            normed, residual = self.ops.add_rms_norm(hidden, residual, self.input_norm, self.eps)
        attn_out = self._attention(normed, ctx)
        normed, residual = self.ops.add_rms_norm(attn_out, residual, self.ffn_norm, self.eps)
        return self.ffn(normed, ctx), residual

    def _decode_one(self, hidden, residual, ctx: ForwardContext):
        """One token through the fused GEMVs: returns (hidden + attention + FFN, None)."""
        w, ops = self.weights, self.ops
        qkv, stream = ops.gemv_norm(hidden, residual, self.input_norm, self.eps, w.qkv)
        out = self._decode_attention(qkv, ctx).reshape(1, self.spec.attention.q_size)
        stream = self.tp.reduce(ops.gemv_add(out, w.o, self.tp.addend(stream), self._gate(qkv)))
        return self.ffn.add_row(stream, self.ffn_norm, self.eps), None

    def _attention(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        w = self.weights
        qkv = self.ops.linear(x, w.qkv, w.qkv_bias)
        if ctx.is_prefill:
            q = self._prepare(qkv, ctx)
            out = self.attention.paged_prefill(q, self.kv, ctx.block_table, ctx.start_pos, self.scale)
            out = restore_output(self.ops, out, self.kv.v)
        else:
            out = self._decode_attention(qkv, ctx)
        return self.tp.reduce(self.ops.linear(self._gated(out, qkv), w.o, w.o_bias))

    def _gate(self, qkv: torch.Tensor) -> torch.Tensor | None:
        """The output gate's pre-activations (T, Hq*D): the last columns of qkv; None without one."""
        a = self.spec.attention
        return qkv[:, -a.q_size:] if a.output_gate else None

    def _gated(self, out: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """out (T, Hq, D) -> (T, Hq*D), times sigmoid(gate) with an output gate (HF's order: in the
        activations' dtype, before o_proj)."""
        out, gate = out.reshape(qkv.shape[0], self.spec.attention.q_size), self._gate(qkv)
        return out if gate is None else out * torch.sigmoid(gate)

    def _decode_attention(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """One token per sequence: QK-norm, RoPE, the cache write and paged decode -> (B, Hq, D).
        One backend call once calibration has frozen (one launch on the cuda backend's bf16 / fp8
        cache; on another, the rotations of a rotated side ride in the write and decode launches);
        else :meth:`_prepare` and the decode."""
        w, kv = self.weights, self.kv
        if self.frozen():
            q, k, v = self._split(qkv)
            return self.attention.rope_cache_decode(q, k, v, kv, ctx.slot_mapping, ctx.positions, self.rope_cos,
                                                    self.rope_sin, w.q_norm, w.k_norm, self.eps, ctx.block_tables,
                                                    ctx.seq_lens, self.scale)
        q = self._prepare(qkv, ctx)
        return self.attention.paged_decode(q, kv, ctx.block_tables, ctx.seq_lens, self.scale, restore_v=True)

    def _split(self, qkv: torch.Tensor):
        """A fused projection's output -> q (T, Hq, D), k, v (T, Hk, D): views (past a gate's rows)."""
        a, tokens = self.spec.attention, qkv.shape[0]
        q, k, v = qkv[:, : a.q_size + 2 * a.kv_size].split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        d = a.head_dim
        return q.view(tokens, a.num_heads, d), k.view(tokens, a.num_kv_heads, d), v.view(tokens, a.num_kv_heads, d)

    def _prepare(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Split, QK-norm, RoPE, calibrate, write the cache, rotate Q: the query for the kernels.

        Once this layer's online calibration (fp8 scales, InnerQ) has frozen, nothing needs the
        rotated K on the host side, and QK-norm, RoPE, the cache write and Q's rotation are one
        launch."""
        w, ops, kv = self.weights, self.ops, self.kv
        tokens, d = qkv.shape[0], self.spec.attention.head_dim
        q, k, v = self._split(qkv)
        if self.frozen():
            return self.attention.rope_and_cache(q, k, v, kv, ctx.slot_mapping, ctx.positions, self.rope_cos,
                                                 self.rope_sin, w.q_norm, w.k_norm, self.eps, rotate_q=True)
        v = v.contiguous()
        if w.q_norm is not None:
            q = ops.rms_norm(q.reshape(-1, d), w.q_norm, self.eps).view(tokens, -1, d)
            k = ops.rms_norm(k.reshape(-1, d), w.k_norm, self.eps).view(tokens, -1, d)
        q, k = ops.rope(q.contiguous(), k.contiguous(), ctx.positions, self.rope_cos, self.rope_sin)
        self.calibration.observe(self.idx, k, v, ctx.slot_mapping)
        self.attention.reshape_and_cache(k, v, kv, ctx.slot_mapping)
        return rotate_query(ops, q, kv.k)
