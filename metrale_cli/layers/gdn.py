"""GatedDeltaNetLayer: the linear-attention layer of the Qwen3-Next / Qwen3.5 hybrids.

RMSNorm (fused with the residual add) -> one projection to [q; k; v; z; b; a] -> causal depthwise
conv1d + SiLU over q, k, v (its last K-1 inputs kept per sequence) -> the gated delta rule over
L2-normalised q / k (key heads repeated to the value heads), decay g = -exp(A_log) *
softplus(a + dt_bias), rate beta = sigmoid(b), a (head_k_dim, head_v_dim) fp32 state per value
head and sequence -> RMSNorm gated by silu(z) -> out_proj -> residual add + the pre-FFN norm ->
FFN component. No KV cache: a sequence's conv window and recurrent state live in this layer's
:class:`GdnStatePool`, a slot per sequence (``alloc_state`` / ``release_state``).

Prefill runs the chunked (WY) form and decode the token-by-token form of
``kernels/gdn_reference.py`` on either backend: the math is torch ops on the activations'
device (no CUDA kernel serves it yet), and decode reads each sequence's slot from the host, so
its step is not graph-captured (:meth:`decode_graph_unsupported`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import gdn_reference as gdn
from metrale_cli.kernels.ops import Ops
from metrale_cli.layers.context import ForwardContext
from metrale_cli.layers.protocols import FfnComponent
from metrale_cli.layers.spec import GdnSpec, LayerSpec


@dataclass
class GdnWeights:
    """``in_proj``: (2*key_dim + 2*value_dim + 2*Hv, hidden), rows [q; k; v; z; b; a], each part
    head-major (HF's per-key-head interleaving undone at load); ``conv``: (conv_dim, K) over
    [q; k; v]; ``out``: (hidden, value_dim)."""

    in_proj: torch.Tensor
    conv: torch.Tensor
    dt_bias: torch.Tensor  # (Hv,)
    a_log: torch.Tensor  # (Hv,)
    norm: torch.Tensor  # (Dv,): the gated norm's weight
    out: torch.Tensor


@dataclass
class GdnState:
    """A sequence's state of one GDN layer: its slot in the layer's pool."""

    slot: int


class GdnStatePool:
    """``slots`` sequences' conv windows (slots + 1, K-1, conv_dim) and recurrent states
    (slots + 1, Hv, Dk, Dv), fp32, allocated once; the extra last slot is scratch for padding rows
    and for a forward given no state."""

    def __init__(self, spec: GdnSpec, slots: int, layer: int, device: torch.device):
        self.layer, self.slots = layer, slots
        self.conv = torch.zeros(slots + 1, spec.conv_kernel - 1, spec.conv_dim, device=device)
        self.recurrent = torch.zeros(slots + 1, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim, device=device)
        self._free = list(range(slots - 1, -1, -1))

    @property
    def scratch(self) -> int:
        return self.slots

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self) -> GdnState:
        if not self._free:
            raise MetraleError(f"GDN state pool exhausted: all {self.slots} state slots of layer {self.layer} "
                               "are held by running sequences",
                               hint="run fewer sequences at once or raise max_num_seqs (--batch for bench)")
        return GdnState(self._free.pop())

    def release(self, state: GdnState) -> None:
        self._free.append(state.slot)

    def reset(self, slot: int) -> None:
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()


class GatedDeltaNetLayer:
    """A :class:`~metrale_cli.layers.protocols.Layer`: pre-norm Gated DeltaNet with its state
    ``pool``, then the pre-norm FFN component ``ffn``."""

    def __init__(self, spec: LayerSpec, weights: GdnWeights, input_norm: torch.Tensor, ffn_norm: torch.Tensor,
                 ffn: FfnComponent, ops: Ops, pool: GdnStatePool):
        self.spec, self.weights, self.ffn, self.ops, self.pool = spec, weights, ffn, ops, pool
        self.input_norm, self.ffn_norm, self.eps = input_norm, ffn_norm, spec.eps
        self.gdn = spec.gdn

    # --- the layer protocol -------------------------------------------------------------
    def alloc_state(self) -> GdnState:
        return self.pool.alloc()

    def release_state(self, state: GdnState) -> None:
        self.pool.release(state)

    def free_states(self) -> int:
        """How many more sequences this layer can hold state for."""
        return self.pool.free

    def state_bytes(self) -> int:
        """Bytes of one sequence's state in this layer."""
        return self.gdn.state_bytes()

    def decode_graph_unsupported(self) -> str | None:
        return "the Gated DeltaNet layer runs its torch reference, reading each sequence's state slot on the host"

    def tensors(self) -> list[torch.Tensor]:
        w = self.weights
        return [w.in_proj, w.conv, w.dt_bias, w.a_log, w.norm, w.out, self.input_norm, self.ffn_norm,
                *self.ffn.tensors()]

    def routed_bytes(self) -> int:
        return self.ffn.routed_bytes()

    def prefill(self, hidden, residual, state: GdnState | None, ctx: ForwardContext):
        """One chunk of one sequence; at ``start_pos`` 0 the sequence starts from a zero state."""
        return self._forward(hidden, residual, ctx, lambda x: self._sequence(x, state, fresh=ctx.start_pos == 0))

    def decode_batched(self, hidden, residual, state: GdnState, ctx: ForwardContext):
        """K tokens of one sequence, continuing its state (no rollback: a rejected draft token
        would need the state before it)."""
        return self._forward(hidden, residual, ctx, lambda x: self._sequence(x, state, fresh=False))

    def decode(self, hidden, residual, state: GdnState, ctx: ForwardContext):
        return self.decode_multi_seq(hidden, residual, [state], ctx)

    def decode_multi_seq(self, hidden, residual, states: list[GdnState | None], ctx: ForwardContext):
        return self._forward(hidden, residual, ctx, lambda x: self._step(x, states))

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
        return F.linear(x, self.weights.in_proj).split([s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], -1)

    def _sequence(self, x: torch.Tensor, state: GdnState | None, fresh: bool) -> torch.Tensor:
        """T tokens of one sequence: the conv over its window, the chunked rule over its state."""
        slot = self.pool.scratch if state is None else state.slot
        if fresh or state is None:
            self.pool.reset(slot)
        mixed, z, b, a = self._project(x)
        mixed = gdn.causal_conv1d(mixed, self.pool.conv[slot], self.weights.conv)
        recurrent = self.pool.recurrent[slot : slot + 1]
        return self._mix(mixed[None], z, b[None], a[None], recurrent, gdn.chunked_gated_delta_rule)

    def _step(self, x: torch.Tensor, states: list[GdnState | None]) -> torch.Tensor:
        """One token per sequence: each row's window and state gathered from its slot and written back."""
        slots = torch.tensor([self.pool.scratch if s is None else s.slot for s in states], device=x.device)
        mixed, z, b, a = self._project(x)
        mixed, windows = gdn.causal_conv1d_step(mixed, self.pool.conv[slots], self.weights.conv)
        self.pool.conv[slots] = windows
        recurrent = self.pool.recurrent[slots]
        out = self._mix(mixed[:, None], z, b[:, None], a[:, None], recurrent, gdn.recurrent_gated_delta_rule)
        self.pool.recurrent[slots] = recurrent
        return out

    def _mix(self, mixed, z, b, a, recurrent, rule) -> torch.Tensor:
        """mixed: (B, T, conv_dim) after the conv; z: (B*T, value_dim); b, a: (B, T, Hv) ->
        (B*T, hidden). ``recurrent`` (B, Hv, Dk, Dv) is updated in place by ``rule``."""
        s, w = self.gdn, self.weights
        rows, tokens = mixed.shape[:2]
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], -1)
        group = s.num_v_heads // s.num_k_heads
        q, k = (t.reshape(rows, tokens, s.num_k_heads, s.head_k_dim).repeat_interleave(group, dim=2) for t in (q, k))
        v = v.reshape(rows, tokens, s.num_v_heads, s.head_v_dim)
        g = -w.a_log.float().exp() * F.softplus(a.float() + w.dt_bias)
        out = rule(q, k, v, g, b.sigmoid(), recurrent)
        out = gdn.gated_rms_norm(out.reshape(-1, s.head_v_dim), z.reshape(-1, s.head_v_dim), w.norm, self.eps)
        return F.linear(out.reshape(rows * tokens, s.value_dim), w.out)
