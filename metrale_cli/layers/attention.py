"""Qwen3AttentionLayer: the full-attention transformer layer (the seed engine's name and role).

RMSNorm (fused with the residual add) -> fused q/k/v projection -> optional QK-norm -> RoPE ->
KV-cache write (these three one launch once calibration has frozen) -> paged attention ->
o_proj -> residual add + post-attention norm -> FFN component. Batch-1 decode on a backend
whose fused GEMVs serve the model (``Ops.gemv_fits``) runs each projection as one launch with its
neighbour: norm + q/k/v, o_proj + residual add, norm + gate/up + SwiGLU, down + residual add; the
layer then hands on the running sum alone (``residual`` None). WHT bookends: when the layer's K
side is stored rotated, Q is rotated the same way (and divided by the InnerQ channel scales)
before attention, so scores are unchanged; when the V side is rotated, the attention output
comes back in the rotated basis and is rotated back. Layers pass ``(hidden, residual)`` on, vLLM
style: the residual add of one sub-layer is fused into the next norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metrale_cli.config import ModelConfig
from metrale_cli.kernels.ops import Ops, SidePool, StackLayer
from metrale_cli.kv.fp8 import Fp8ScalePolicy
from metrale_cli.kv.innerq import InnerQPolicy
from metrale_cli.kv.paged import PagedKvCache
from metrale_cli.layers.context import ForwardContext
from metrale_cli.layers.ffn import DenseSwiGluFfn
from metrale_cli.layers.host_timing import phase


@dataclass
class AttentionWeights:
    qkv: torch.Tensor  # (Hq*D + 2*Hk*D, hidden)
    o: torch.Tensor  # (hidden, Hq*D)
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # (D,)
    k_norm: torch.Tensor | None = None


@dataclass
class AttnLayerState:
    """Per-sequence state of a full-attention layer: empty, its K/V live in the paged cache.

    Recurrent layers (Gated DeltaNet) keep conv and recurrent state here instead.
    """


def rotate_query(ops: Ops, q: torch.Tensor, k_pool: SidePool) -> torch.Tensor:
    """q: (T, Hq, D) -> the query the kernels expect for ``k_pool``: R·q / channel_scale when the
    K side is rotated (query head h divided by the scales of KV head h // (Hq // Hk)), else q."""
    if not k_pool.rotated:
        return q
    tokens, hq, d = q.shape
    q = ops.wht(q.reshape(-1, d).contiguous(), k_pool.signs, False).view(tokens, hq, d)
    if k_pool.channel_scale is not None:
        hk = k_pool.num_kv_heads
        grouped = q.view(tokens, hk, hq // hk, d).float() / k_pool.channel_scale[None, :, None, :]
        q = grouped.to(q.dtype).view(tokens, hq, d)
    return q


def restore_output(ops: Ops, out: torch.Tensor, v_pool: SidePool) -> torch.Tensor:
    """out: (T, Hq, D) in the V side's basis -> the original basis (Rᵀ·out when V is rotated)."""
    if not v_pool.rotated:
        return out
    tokens, hq, d = out.shape
    return ops.wht(out.reshape(-1, d).contiguous(), v_pool.signs, True).view(tokens, hq, d)


class Qwen3AttentionLayer:
    def __init__(
        self,
        layer_idx: int,
        config: ModelConfig,
        input_norm: torch.Tensor,
        attn: AttentionWeights,
        post_attn_norm: torch.Tensor,
        ffn: DenseSwiGluFfn,
        ops: Ops,
        kv_cache: PagedKvCache,
        fp8_scales: Fp8ScalePolicy,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        innerq: InnerQPolicy | None = None,
    ):
        self.idx = layer_idx
        self.cfg = config
        self.input_norm = input_norm
        self.attn = attn
        self.post_attn_norm = post_attn_norm
        self.ffn = ffn
        self.ops = ops
        self.kv = kv_cache
        self.fp8_scales = fp8_scales
        self.innerq = innerq
        self.rope_cos, self.rope_sin = rope_cos, rope_sin
        self.scale = config.head_dim**-0.5
        self.fused_decode = (
            isinstance(ffn, DenseSwiGluFfn) and attn.qkv_bias is None and attn.o_bias is None
            and all(t.dtype == torch.bfloat16 for t in (attn.qkv, attn.o, ffn.gate_up, ffn.down))
            and all(ops.gemv_fits(k) for k in (config.hidden_size, config.q_size, ffn.down.shape[1]))
        )

    def stack_layer(self) -> StackLayer | None:
        """This layer as part of a whole-stack decode step (``Ops.decode_stack``), or None where
        its decode step is not the fused one (biases, a non-SwiGLU FFN, weights the fused GEMVs
        do not take) or its KV cache is calibrated online."""
        if not (self.fused_decode and self._frozen()):
            return None
        w = self.attn
        kp, vp = self.kv.pools(self.idx)
        return StackLayer(w.qkv, w.o, self.ffn.gate_up, self.ffn.down, self.input_norm, self.post_attn_norm,
                          w.q_norm, w.k_norm, kp, vp)

    # --- the layer protocol -------------------------------------------------------------
    def alloc_state(self) -> AttnLayerState:
        return AttnLayerState()

    def release_state(self, state: AttnLayerState) -> None:
        """Nothing to free: the sequence's blocks are released by the cache's owner."""

    def decode_graph_unsupported(self) -> str | None:
        """Why this layer's decode step cannot be captured in a CUDA graph, or None if it can.

        The cuda kernels read every step input from device buffers; the torch references
        gather each sequence's context with host-side lengths, which a graph would freeze.
        """
        if self.ops.name != "cuda":
            return f"the {self.ops.name} backend's attention reads context lengths on the host"
        return None

    def prefill(self, hidden, residual, ctx: ForwardContext):
        """One chunk of one sequence. hidden/residual: (T, hidden); residual None on layer 0.

        Tokens whose slot is -1 (a prefix-cache skip below ``kv_write_start``) are not written.
        """
        return self._forward(hidden, residual, ctx)

    def decode_multi_seq(self, hidden, residual, ctx: ForwardContext):
        """One new token for each of B sequences (one row per sequence)."""
        return self._forward(hidden, residual, ctx)

    def decode(self, hidden, residual, ctx: ForwardContext):
        """One token of one sequence: decode_multi_seq with B = 1."""
        return self._forward(hidden, residual, ctx)

    def decode_batched(self, hidden, residual, ctx: ForwardContext):
        """K tokens of one sequence in one pass (speculative verify): a short causal prefill."""
        return self._forward(hidden, residual, ctx)

    # --- the body -------------------------------------------------------------------------
    def _forward(self, hidden, residual, ctx: ForwardContext):
        if self.fused_decode and not ctx.is_prefill and hidden.shape[0] == 1:
            return self._decode_one(hidden, residual, ctx)
        eps = self.cfg.rms_norm_eps
        if residual is None:
            residual = hidden
            normed = self.ops.rms_norm(hidden, self.input_norm, eps)
        else:
            normed, residual = self.ops.add_rms_norm(hidden, residual, self.input_norm, eps)
        timing = ctx.timing if ctx.is_prefill else None
        attn_out = self._attention(normed, ctx, timing)
        normed, residual = self.ops.add_rms_norm(attn_out, residual, self.post_attn_norm, eps)
        with phase(timing, "ffn"):
            return self.ffn(normed), residual

    def _decode_one(self, hidden, residual, ctx: ForwardContext):
        """One token through the fused GEMVs: returns (hidden + attention + FFN, None)."""
        cfg, w, ops, eps = self.cfg, self.attn, self.ops, self.cfg.rms_norm_eps
        qkv, stream = ops.gemv_norm(hidden, residual, self.input_norm, eps, w.qkv)
        out = self._decode_attention(qkv, ctx)
        stream = ops.gemv_add(out.reshape(1, cfg.q_size), w.o, stream)
        act, _ = ops.gemv_norm_swiglu(stream, None, self.post_attn_norm, eps, self.ffn.gate_up)
        return ops.gemv_add(act, self.ffn.down, stream), None

    def _attention(self, x: torch.Tensor, ctx: ForwardContext, timing) -> torch.Tensor:
        cfg, w, ops = self.cfg, self.attn, self.ops
        with phase(timing, "projections"):
            qkv = F.linear(x, w.qkv, w.qkv_bias)
        if ctx.is_prefill:
            with phase(timing, "to attention call"):
                q, kp, vp = self._prepare(qkv, ctx)
            with phase(timing, "attention call"):
                out = restore_output(ops, ops.paged_prefill(q, kp, vp, ctx.block_table, ctx.start_pos, self.scale), vp)
        else:
            out = self._decode_attention(qkv, ctx)
        return F.linear(out.reshape(x.shape[0], cfg.q_size), w.o, w.o_bias)

    def _decode_attention(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """One token per sequence: QK-norm, RoPE, the cache write and paged decode -> (B, Hq, D).
        One backend call (one launch on the cuda backend's bf16 / fp8 cache) once calibration has
        frozen and neither side is rotated; else :meth:`_prepare` and the decode."""
        cfg, w, ops = self.cfg, self.attn, self.ops
        kp, vp = self.kv.pools(self.idx)
        if self._frozen() and not kp.rotated and not vp.rotated:
            q, k, v = self._split(qkv)
            return ops.rope_cache_decode(q, k, v, kp, vp, ctx.slot_mapping, ctx.positions, self.rope_cos,
                                         self.rope_sin, w.q_norm, w.k_norm, cfg.rms_norm_eps, ctx.block_tables,
                                         ctx.seq_lens, self.scale)
        q, kp, vp = self._prepare(qkv, ctx)
        return restore_output(ops, ops.paged_decode(q, kp, vp, ctx.block_tables, ctx.seq_lens, self.scale), vp)

    def _frozen(self) -> bool:
        """This layer's online calibration (fp8 scales, InnerQ) is done: nothing needs the roped K
        on the host side any more."""
        i = self.idx
        return bool(self.fp8_scales.frozen[i]) and (self.innerq is None or bool(self.innerq.frozen[i]))

    def _split(self, qkv: torch.Tensor):
        """A fused projection's output -> q (T, Hq, D), k, v (T, Hk, D): views."""
        cfg, tokens, d = self.cfg, qkv.shape[0], self.cfg.head_dim
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        hk = cfg.num_kv_heads
        return q.view(tokens, cfg.num_heads, d), k.view(tokens, hk, d), v.view(tokens, hk, d)

    def _prepare(self, qkv: torch.Tensor, ctx: ForwardContext):
        """Split, QK-norm, RoPE, calibrate, write the cache, rotate Q: (q, k_pool, v_pool).

        Once this layer's online calibration (fp8 scales, InnerQ) has frozen, nothing needs the
        rotated K on the host side, and QK-norm, RoPE and the cache write are one launch."""
        cfg, w, ops, i = self.cfg, self.attn, self.ops, self.idx
        tokens, d = qkv.shape[0], cfg.head_dim
        q, k, v = self._split(qkv)
        kp, vp = self.kv.pools(i)
        if self._frozen():
            q = ops.rope_and_cache(q, k, v, kp, vp, ctx.slot_mapping, ctx.positions, self.rope_cos,
                                   self.rope_sin, w.q_norm, w.k_norm, cfg.rms_norm_eps)
            return rotate_query(ops, q, kp), kp, vp
        v = v.contiguous()
        if w.q_norm is not None:
            q = ops.rms_norm(q.reshape(-1, d), w.q_norm, cfg.rms_norm_eps).view(tokens, -1, d)
            k = ops.rms_norm(k.reshape(-1, d), w.k_norm, cfg.rms_norm_eps).view(tokens, -1, d)
        q, k = ops.rope(q.contiguous(), k.contiguous(), ctx.positions, self.rope_cos, self.rope_sin)
        self.fp8_scales.observe(i, k, v)
        if self.innerq is not None:
            self.innerq.observe(i, k, ctx.slot_mapping)
        ops.reshape_and_cache(k, v, kp, vp, ctx.slot_mapping)
        return rotate_query(ops, q, kp), kp, vp
