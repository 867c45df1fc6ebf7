"""CausalLM: embeddings, a list of layers behind one protocol, final norm and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale_cli.config import ModelConfig
from metrale_cli.kernels.ops import Ops
from metrale_cli.kv.calibration import KvCalibration
from metrale_cli.kv.paged import PagedKvCache
from metrale_cli.layers.context import ForwardContext
from metrale_cli.layers.protocols import Layer, LayerState
from metrale_cli.layers.parallel import SINGLE, TensorParallel


class CausalLM:
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[Layer], final_norm: torch.Tensor,
                 lm_head: torch.Tensor, ops: Ops, kv_cache: PagedKvCache, calibration: KvCalibration,
                 tp: TensorParallel = SINGLE):
        self.cfg, self.tp = cfg, tp
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.ops = ops
        self.kv_cache = kv_cache
        self.calibration = calibration
        # the recurrent-state pool the layers share (Layer.uses_ssm_pool), None without one
        self.ssm_pool = next((layer.ssm_pool for layer in layers if layer.uses_ssm_pool()), None)

    def alloc_states(self) -> list[LayerState]:
        """A new sequence's state of every layer (``Layer.alloc_state``), with one slot of the
        recurrent-state pool for all its recurrent layers (an exhausted pool raises)."""
        pool = self.ssm_pool
        slot = pool.alloc() if pool is not None else None
        return [layer.alloc_state(slot) for layer in self.layers]

    def ssm_slot(self, states: list[LayerState]) -> int | None:
        """The pool slot a sequence's ``states`` hold, None for a model without the pool (or no
        states: a padding row)."""
        return next((state.slot for layer, state in zip(self.layers, states) if layer.uses_ssm_pool()), None)

    def release_states(self, states: list[LayerState]) -> None:
        slot, pool = self.ssm_slot(states), self.ssm_pool
        for layer, state in zip(self.layers, states):
            layer.release_state(state)
        if slot is not None:
            pool.release(slot)
        states.clear()

    def free_state_slots(self) -> int | None:
        """How many more sequences the recurrent-state pool can hold; None without one."""
        pool = self.ssm_pool
        return None if pool is None else pool.free

    def state_bytes_per_sequence(self) -> int:
        """Bytes of one sequence's state outside the KV cache, over every layer."""
        return sum(layer.state_bytes() for layer in self.layers)

    def state_read_bytes(self) -> int:
        """Bytes of one sequence's recurrent state a decode step reads, over every layer."""
        return sum(s.gdn.step_read_bytes() for s in self.cfg.layers if s.gdn is not None)

    def decode_graph_unsupported(self) -> str | None:
        """The first layer's reason its decode step cannot be graph-captured, else None."""
        return next((f"layer {i}: {why}" for i, layer in enumerate(self.layers)
                     if (why := layer.decode_graph_unsupported())), None)

    @property
    def kv_frozen(self) -> bool:
        """True once every online KV calibration (fp8 scales, InnerQ) has frozen."""
        return self.calibration.all_frozen

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: the layers, the final norm and the LM head (once
        even when tied); an untied embedding table is only gathered, a row per token."""
        tensors = [t for layer in self.layers for t in layer.tensors()] + [self.final_norm, self.lm_head]
        unique = {t.data_ptr(): t for t in tensors}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def routed_bytes(self) -> int:
        """Bytes of routed weights (MoE experts) the layers have read so far; a host sync."""
        return sum(layer.routed_bytes() for layer in self.layers)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, ctx: ForwardContext, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """tokens: (T,) -> float32 logits (len(logit_rows), vocab) of the selected rows; every
        row's (T, vocab) when ``logit_rows`` is None (a decode step: no gather launched)."""
        pick = (lambda x: x) if logit_rows is None else (lambda x: x[logit_rows])
        hidden, residual = self._embed(tokens), None
        for i, layer in enumerate(self.layers):
            states = ctx.layer_states(i)
            if ctx.is_prefill:
                hidden, residual = layer.prefill(hidden, residual, states[0] if states else None, ctx)
            else:
                hidden, residual = layer.decode_multi_seq(hidden, residual, states, ctx)
        logits = self._logits(pick(hidden), None if residual is None else pick(residual)).float()
        return self.tp.gather_columns(logits)[:, : self.cfg.vocab_size] if self.tp.size > 1 else logits

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; a tensor-parallel rank looks up the rows of its vocabulary shard
        (zeros for the others) and the ranks' rows are summed."""
        if self.tp.size == 1:
            return F.embedding(tokens, self.embed)
        rows = self.embed.shape[0]
        local = tokens - self.tp.rank * rows
        mine = (local >= 0) & (local < rows)
        hidden = F.embedding(local.clamp(0, rows - 1), self.embed) * mine[:, None].to(self.embed.dtype)
        return self.tp.reduce(hidden)

    def _logits(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Final norm and LM head; ``residual`` None when the layers handed on the sum alone. Float32
        logits from the batch-1 GEMV, the weight's dtype otherwise (``forward`` widens them)."""
        eps = self.cfg.rms_norm_eps
        if hidden.shape[0] == 1 and self.ops.gemv_fits(self.lm_head.shape[1], self.lm_head.dtype):
            return self.ops.gemv_norm_logits(hidden, residual, self.final_norm, eps, self.lm_head)
        if residual is None:
            normed = self.ops.rms_norm(hidden, self.final_norm, eps)
        else:
            normed, _ = self.ops.add_rms_norm(hidden, residual, self.final_norm, eps)
        return F.linear(normed, self.lm_head)
