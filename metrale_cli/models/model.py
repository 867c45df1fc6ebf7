"""CausalLM: embeddings, a list of layers behind one protocol, final norm and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale_cli.config import ModelConfig
from metrale_cli.kernels.ops import DecodeStack, Ops
from metrale_cli.kv.fp8 import Fp8ScalePolicy
from metrale_cli.kv.innerq import InnerQPolicy
from metrale_cli.kv.paged import PagedKvCache
from metrale_cli.layers.context import ForwardContext


class CausalLM:
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list, final_norm: torch.Tensor,
                 lm_head: torch.Tensor, ops: Ops, kv_cache: PagedKvCache, fp8_scales: Fp8ScalePolicy,
                 innerq: InnerQPolicy | None = None):
        self.cfg = cfg
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.ops = ops
        self.kv_cache = kv_cache
        self.fp8_scales = fp8_scales
        self.innerq = innerq
        self.stack_plan = None  # the whole-stack batch-1 decode step, once planned

    def plan_decode_stack(self) -> bool:
        """Run batch-1 decode through the backend's whole-stack step from now on, where it has one
        for these layers (every layer must offer its part, ``stack_layer``); else the layers keep
        running one by one. Returns whether it was planned."""
        parts = [getattr(layer, "stack_layer", lambda: None)() for layer in self.layers]
        if not parts or any(p is None for p in parts):
            return False
        first, cfg = self.layers[0], self.cfg
        stack = DecodeStack(parts, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                            first.scale, first.rope_cos, first.rope_sin)
        self.stack_plan = self.ops.decode_stack_plan(stack)
        return self.stack_plan is not None

    def decode_graph_unsupported(self) -> str | None:
        """The first layer's reason its decode step cannot be graph-captured, else None."""
        return next((f"layer {i}: {why}" for i, layer in enumerate(self.layers)
                     if (why := layer.decode_graph_unsupported())), None)

    @property
    def kv_frozen(self) -> bool:
        """True once every online KV calibration (fp8 scales, InnerQ) has frozen."""
        return all(self.fp8_scales.frozen) and (self.innerq is None or all(self.innerq.frozen))

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: the layers, the final norm and the LM head (once
        even when tied); an untied embedding table is only gathered, a row per token."""
        return self.cfg.decode_parameters() * self.embed.element_size()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, ctx: ForwardContext, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """tokens: (T,) -> float32 logits (len(logit_rows), vocab) of the selected rows; every
        row's (T, vocab) when ``logit_rows`` is None (a decode step: no gather launched)."""
        pick = (lambda x: x) if logit_rows is None else (lambda x: x[logit_rows])
        hidden, residual = F.embedding(tokens, self.embed), None
        if self.stack_plan is not None and not ctx.is_prefill and tokens.shape[0] == 1:
            hidden = self.ops.decode_stack(self.stack_plan, hidden, ctx)
            return self._logits(pick(hidden), None).float()
        for layer in self.layers:
            step = layer.prefill if ctx.is_prefill else layer.decode_multi_seq
            hidden, residual = step(hidden, residual, ctx)
        return self._logits(pick(hidden), None if residual is None else pick(residual)).float()

    def _logits(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Final norm and LM head; ``residual`` None when the layers handed on the sum alone. Float32
        logits from the batch-1 GEMV, the weight's dtype otherwise (``forward`` widens them)."""
        eps = self.cfg.rms_norm_eps
        if hidden.shape[0] == 1 and self.lm_head.dtype == torch.bfloat16 and self.ops.gemv_fits(hidden.shape[1]):
            return self.ops.gemv_norm_logits(hidden, residual, self.final_norm, eps, self.lm_head)
        if residual is None:
            normed = self.ops.rms_norm(hidden, self.final_norm, eps)
        else:
            normed, _ = self.ops.add_rms_norm(hidden, residual, self.final_norm, eps)
        return F.linear(normed, self.lm_head)
