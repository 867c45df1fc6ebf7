"""GatedDeltaNetLayer: the linear-attention layer of the Qwen3-Next / Qwen3.5 hybrids.

RMSNorm (fused with the residual add) -> one projection to [q; k; v; z; b; a] -> causal depthwise
conv1d + SiLU over q, k, v (its last K-1 inputs kept per sequence) -> the gated delta rule over
L2-normalised q / k (key heads repeated to the value heads), decay g = -exp(A_log) *
softplus(a + dt_bias), rate beta = sigmoid(b), a (head_k_dim, head_v_dim) fp32 state per value
head and sequence -> RMSNorm gated by silu(z) -> out_proj -> residual add + the pre-FFN norm ->
FFN component. No KV cache: a sequence's conv window and recurrent state live in the model's
:class:`SsmStatePool` (``uses_ssm_pool``), one slot per sequence shared by every GDN layer,
taken and given back by the model for the sequence (``CausalLM.alloc_states``).

The mixer between the projections is the backend's (``Ops.gdn_prefill``: the chunked form;
``Ops.gdn_decode``: one token per row, its slots and positions read from device buffers, so a
decode step is graph-captured like an attention one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import GdnTensors, Ops
from metrale_cli.layers.context import ForwardContext
from metrale_cli.layers.protocols import FfnComponent
from metrale_cli.layers.spec import LayerSpec
from metrale_cli.layers.parallel import SINGLE, TensorParallel


GDN_RANGE = "gdn mixer"  # the profiler range around a prefill's mixer (bench's prefill split)


@dataclass
class GdnWeights:
    """``in_proj``: (2*key_dim + 2*value_dim + 2*Hv, hidden), rows [q; k; v; z; b; a], each part
    head-major (HF's per-key-head interleaving undone at load); ``conv``: (conv_dim, K) over
    [q; k; v]; ``out``: (hidden, value_dim); ``dt_bias`` / ``a_log`` float32 (HF adds and exps
    them in fp32)."""

    in_proj: torch.Tensor
    conv: torch.Tensor
    dt_bias: torch.Tensor  # (Hv,)
    a_log: torch.Tensor  # (Hv,)
    norm: torch.Tensor  # (Dv,): the gated norm's weight
    out: torch.Tensor


@dataclass
class GdnState:
    """A sequence's state of one GDN layer: its slot in the model's :class:`SsmStatePool`."""

    slot: int


class SsmStatePool:
    """The recurrent state of every GDN layer of a model, ``slots`` sequences at once: per layer
    the conv's last K inputs (slots + 1, K, conv_dim) (the input at position p in entry p % K) and
    the rule's state (slots + 1, Hv, Dk, Dv), fp32, allocated once. A sequence holds one slot in
    every layer (so a decode step's rows name their slots in one device buffer); the extra last
    slot is scratch for padding rows and for a forward given no state."""

    def __init__(self, specs: list[LayerSpec], slots: int, device: torch.device):
        self.slots = slots
        self.conv = {s.index: torch.zeros(slots + 1, s.gdn.conv_kernel, s.gdn.conv_dim, device=device) for s in specs}
        self.recurrent = {s.index: torch.zeros(slots + 1, s.gdn.num_v_heads, s.gdn.head_k_dim, s.gdn.head_v_dim,
                                               device=device) for s in specs}
        self._free = list(range(slots - 1, -1, -1))

    @property
    def scratch(self) -> int:
        return self.slots

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise MetraleError(f"recurrent state pool exhausted: all {self.slots} state slots are held by running "
                               "sequences",
                               hint="run fewer sequences at once or raise max_num_seqs (--batch for bench)")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def save(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """A copy of the given slots' state in every layer (for :meth:`restore`)."""
        rows = slots.long()
        return [(rows, self.conv[i][rows], self.recurrent[i][rows]) for i in self.conv]

    def restore(self, saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        for i, (rows, conv, recurrent) in zip(self.conv, saved):
            self.conv[i][rows] = conv
            self.recurrent[i][rows] = recurrent

    def reset(self, layer: int, slot: int) -> None:
        self.conv[layer][slot].zero_()
        self.recurrent[layer][slot].zero_()


class GatedDeltaNetLayer:
    """A :class:`~metrale_cli.layers.protocols.Layer`: pre-norm Gated DeltaNet with its state
    ``pool``, then the pre-norm FFN component ``ffn``. As a tensor-parallel shard (``tp``) it holds
    some key heads and their value heads: out_proj's output is summed over the ranks (at batch 1 with
    the residual that rank 0 alone adds in the fused GEMV)."""

    def __init__(self, spec: LayerSpec, weights: GdnWeights, input_norm: torch.Tensor, ffn_norm: torch.Tensor,
                 ffn: FfnComponent, ops: Ops, pool: SsmStatePool, tp: TensorParallel = SINGLE):
        self.spec, self.weights, self.ffn, self.ops, self.ssm_pool, self.tp = spec, weights, ffn, ops, pool, tp
        self.input_norm, self.ffn_norm, self.eps = input_norm, ffn_norm, spec.eps
        self.gdn = spec.gdn
        self.mixer = GdnTensors(weights.conv, weights.a_log, weights.dt_bias, weights.norm, spec.eps,
                                spec.gdn.num_k_heads, pool.conv[spec.index], pool.recurrent[spec.index])
        w = weights
        # batch-1 decode through the fused GEMVs (as Qwen3AttentionLayer): norm + in_proj, out_proj
        # + the residual add, the FFN's own row path
        self.fused_decode = ffn.fuses_row and all(ops.gemv_fits(t.shape[1], t.dtype) for t in (w.in_proj, w.out))

    # --- the layer protocol -------------------------------------------------------------
    def is_ssm_layer(self) -> bool:
        return True

    def uses_ssm_pool(self) -> bool:
        return True

    def alloc_state(self, ssm_slot: int | None = None) -> GdnState:
        """The sequence's slot of the model's pool (``CausalLM.alloc_states`` takes it)."""
        if ssm_slot is None:
            raise MetraleError("a Gated DeltaNet layer's state is a slot of the model's state pool",
                               hint="allocate sequence states with CausalLM.alloc_states")
        return GdnState(ssm_slot)

    def release_state(self, state: GdnState) -> None:
        """Nothing of its own: the model gives the slot back to the pool."""

    def state_bytes(self) -> int:
        """Bytes of one sequence's state in this layer."""
        return self.gdn.state_bytes()

    def decode_graph_unsupported(self) -> str | None:
        return None

    def tensors(self) -> list[torch.Tensor]:
        w = self.weights
        return [w.in_proj, w.conv, w.dt_bias, w.a_log, w.norm, w.out, self.input_norm, self.ffn_norm,
                *self.ffn.tensors()]

    def routed_bytes(self) -> int:
        return self.ffn.routed_bytes()

    def prefill(self, hidden, residual, state: GdnState | None, ctx: ForwardContext):
        """One chunk of one sequence; at ``start_pos`` 0 the sequence starts from a zero state."""
        return self._forward(hidden, residual, ctx, lambda x: self._sequence(x, state, ctx.start_pos))

    def decode_batched(self, hidden, residual, state: GdnState, ctx: ForwardContext):
        """K tokens of one sequence, continuing its state from ``ctx.start_pos`` (no rollback: a
        rejected draft token would need the state before it)."""
        return self._forward(hidden, residual, ctx, lambda x: self._sequence(x, state, ctx.start_pos))

    def decode(self, hidden, residual, state: GdnState, ctx: ForwardContext):
        return self.decode_multi_seq(hidden, residual, [state], ctx)

    def decode_multi_seq(self, hidden, residual, states: list[GdnState | None], ctx: ForwardContext):
        """One token per sequence; the rows' slots from ``ctx.ssm_slots`` (a decode step's device
        buffer), else from ``states``."""
        slots = ctx.ssm_slots
        if slots is None:
            slots = torch.tensor([self.ssm_pool.scratch if s is None else s.slot for s in states],
                                 dtype=torch.int32, device=hidden.device)
        if self.fused_decode and hidden.shape[0] == 1:
            return self._decode_one(hidden, residual, slots, ctx.positions)
        return self._forward(hidden, residual, ctx, lambda x: self._step(x, slots, ctx.positions))

    def _decode_one(self, hidden, residual, slots, positions):
        """One token through the fused GEMVs: returns (hidden + mixer + FFN, None)."""
        w, ops, s = self.weights, self.ops, self.gdn
        projected, stream = ops.gemv_norm(hidden, residual, self.input_norm, self.eps, w.in_proj)
        parts = projected.split([s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], -1)
        out = ops.gdn_decode(*parts, self.mixer, slots, positions)
        stream = self.tp.reduce(ops.gemv_add(out, w.out, self.tp.addend(stream)))
        return self.ffn.add_row(stream, self.ffn_norm, self.eps), None

    # --- the body -------------------------------------------------------------------------
    def _forward(self, hidden, residual, ctx: ForwardContext, mixer):
        if residual is None:
            residual = hidden
            normed = self.ops.rms_norm(hidden, self.input_norm, self.eps)
        else:
            normed, residual = self.ops.add_rms_norm(hidden, residual, self.input_norm, self.eps)
        normed, residual = self.ops.add_rms_norm(mixer(normed), residual, self.ffn_norm, self.eps)
        return self.ffn(normed, ctx), residual

    def _project(self, x: torch.Tensor):
        s = self.gdn
        widths = [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads]
        return self.ops.linear(x, self.weights.in_proj).split(widths, -1)

    def _sequence(self, x: torch.Tensor, state: GdnState | None, start_pos: int) -> torch.Tensor:
        """T tokens of one sequence from ``start_pos``: the chunked rule over its slot."""
        slot = self.ssm_pool.scratch if state is None else state.slot
        if start_pos == 0 or state is None:
            self.ssm_pool.reset(self.spec.index, slot)
        with torch.profiler.record_function(GDN_RANGE):
            out = self.ops.gdn_prefill(*self._project(x), self.mixer, slot, start_pos if state is not None else 0)
        return self.tp.reduce(self.ops.linear(out, self.weights.out))

    def _step(self, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row, each continuing its slot."""
        out = self.ops.gdn_decode(*self._project(x), self.mixer, slots, positions)
        return self.tp.reduce(self.ops.linear(out, self.weights.out))
