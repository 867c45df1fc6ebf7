"""The two protocols a model is built from: a layer of the stack and the FFN component it calls.

The engine and the model know layers only through :class:`Layer` (the seed's ``TransformerLayer``),
so a recurrent mixer (Gated DeltaNet) plugs in beside full attention, and a layer knows its FFN
only through :class:`FfnComponent`, so a MoE FFN plugs in without touching the attention layer.
Layers pass ``(hidden, residual)`` on, vLLM style: the residual add of one sub-layer is fused
into the next norm; a layer may hand on the running sum alone (``residual`` None).
"""

from __future__ import annotations

from typing import Protocol

import torch

from metrale_cli.layers.context import ForwardContext
from metrale_cli.layers.spec import LayerSpec

Hidden = tuple[torch.Tensor, "torch.Tensor | None"]


class LayerState(Protocol):
    """A layer's per-sequence state (a recurrent layer's conv and recurrent state). Attention
    layers keep theirs in the paged KV cache and allocate an empty one."""


class Layer(Protocol):
    spec: LayerSpec

    def is_ssm_layer(self) -> bool:
        """Whether this is a recurrent (state-space / linear-attention) layer: a fixed-size state
        per sequence, no KV cache."""

    def uses_ssm_pool(self) -> bool:
        """Whether its recurrent state lives in the model's shared pool (``ssm_pool``), a slot per
        sequence shared by every such layer."""

    def alloc_state(self, ssm_slot: int | None = None) -> LayerState:
        """A new sequence's state of this layer; the model calls it for every layer when a
        sequence is admitted, with the sequence's pool slot (``CausalLM.alloc_states``)."""

    def release_state(self, state: LayerState) -> None:
        """Free what ``state`` holds; the engine calls it when the sequence ends."""

    def state_bytes(self) -> int:
        """Bytes of one sequence's state outside the KV cache (0 for full attention)."""

    def prefill(self, hidden: torch.Tensor, residual: torch.Tensor | None, state: LayerState,
                ctx: ForwardContext) -> Hidden:
        """One chunk of one sequence. hidden / residual: (T, hidden); residual None on layer 0.
        Tokens whose slot is -1 (a prefix-cache skip below ``kv_write_start``) are not written."""

    def decode(self, hidden: torch.Tensor, residual: torch.Tensor | None, state: LayerState,
               ctx: ForwardContext) -> Hidden:
        """One token of one sequence: :meth:`decode_multi_seq` with B = 1."""

    def decode_multi_seq(self, hidden: torch.Tensor, residual: torch.Tensor | None, states: list[LayerState],
                         ctx: ForwardContext) -> Hidden:
        """One new token for each of B sequences (one row per sequence)."""

    def decode_batched(self, hidden: torch.Tensor, residual: torch.Tensor | None, state: LayerState,
                       ctx: ForwardContext) -> Hidden:
        """K tokens of one sequence in one pass (speculative verify)."""

    def decode_graph_unsupported(self) -> str | None:
        """Why this layer's decode step cannot be captured in a CUDA graph, or None if it can."""

    def tensors(self) -> list[torch.Tensor]:
        """The weights a decode step of this layer reads whole (for the bandwidth roofline)."""

    def routed_bytes(self) -> int:
        """Bytes of the weights this layer has read so far that :meth:`tensors` leaves out
        because a step reads only some of them (a MoE FFN's routed experts): counted on the
        device, read here with a host sync."""


class FfnComponent(Protocol):
    """A layer's FFN. ``fuses_row``: it serves :meth:`add_row`, the batch-1 decode path with the
    norm before it and the residual add after it fused into its projections."""

    fuses_row: bool

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: (T, hidden), already normed -> (T, hidden)."""

    def add_row(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """One row: h + ffn(rms_norm(h) * norm_weight) -> (1, hidden), a new tensor."""

    def tensors(self) -> list[torch.Tensor]:
        """The weights a decode step reads whole."""

    def routed_bytes(self) -> int:
        """Bytes of routed weights read so far (see :meth:`Layer.routed_bytes`); 0 when none."""
