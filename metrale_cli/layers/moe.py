"""The mixture-of-experts FFN component (Qwen3-MoE, Qwen2-MoE, and the MoE layers of the hybrids).

A linear router scores every expert; each token goes to its ``top_k`` (softmax over all experts
in fp32, top-k, renormalized when ``norm_topk_prob``); the chosen experts' SwiGLU outputs are
summed with those weights (:meth:`Ops.moe`); an optional shared expert adds
sigmoid(shared_gate(x)) * shared(x). The experts are stored stacked: ``gate_up`` (E, 2I, H) =
[gate; up] per expert and ``down`` (E, H, I), so the backend reads only the experts a step routes
to. ``experts_read`` counts, on the device and without a host sync, the distinct experts each call
read (the bench's roofline counts those bytes, not every expert's).

Where the backend takes it (``Ops.moe_folds_shared``: the cuda backend), the shared expert rides
along with the routed ones: its gate is one more router row, and every row is routed to its
width's chunks of the experts' width too, weighted sigmoid(gate) (:class:`SharedExpert`; the
kernels read the chunks in place, so no weight is copied but the router). Its weights then cost
no launch of their own: apart, at batch 1, they were seven (three GEMVs and four element-wise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale_cli.kernels.ops import Ops, SharedExpert
from metrale_cli.layers.context import ForwardContext
from metrale_cli.layers.ffn import DenseSwiGluFfn
from metrale_cli.layers.spec import MoeSpec
from metrale_cli.layers.parallel import SINGLE, TensorParallel


class MoeFfn:
    """An :class:`~metrale_cli.layers.protocols.FfnComponent`. ``router``: (E, H);
    ``gate_up``: (E, 2I, H); ``down``: (E, H, I); ``shared`` / ``shared_gate`` ((1, H)) together
    or neither. ``fold_shared``: route to the shared expert's chunks rather than run it apart
    (default: as the backend prefers)."""

    def __init__(self, spec: MoeSpec, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ops: Ops,
                 shared: DenseSwiGluFfn | None = None, shared_gate: torch.Tensor | None = None,
                 tp: TensorParallel = SINGLE, fold_shared: bool | None = None):
        if (shared is None) != (shared_gate is None):
            raise ValueError("a shared expert comes with its gate")
        self.spec, self.ops, self.tp = spec, ops, tp
        # add_row: the norm, then the routed experts with the residual add fused in (a
        # tensor-parallel shard's: rank 0's alone, then the sum over the ranks)
        self.fuses_row = True
        self.gate_up, self.down = gate_up, down
        self.shared = None if shared is None else SharedExpert(shared.gate_up, shared.down)
        self.shared_gate = shared_gate
        self.shared_slots = 0  # the shared expert's chunks routed to (0: it runs apart, or there is none)
        # the kernels read the shared width in 8-element pieces; a width they cannot read runs apart
        backend_folds = ops.moe_folds_shared and shared is not None and self.shared.width % 8 == 0
        if shared is not None and (backend_folds if fold_shared is None else fold_shared):
            self.shared_slots = self.shared.chunks(gate_up.shape[1] // 2)
            router = torch.cat([router, shared_gate])  # the gate's logit comes with the experts'
        self.router = router
        self.experts_read = torch.zeros(1, dtype=torch.long, device=router.device)

    @property
    def folded(self) -> SharedExpert | None:
        """The shared expert where it rides along with the routed ones."""
        return self.shared if self.shared_slots else None

    def __call__(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return self._forward(x, None)

    def add_row(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        s = self.spec
        x, route = self.ops.moe_norm_route(h, norm_weight, eps, self.router, s.top_k, s.norm_topk_prob,
                                           self.experts_read, self.shared_slots)
        out = self.ops.moe_routed(x, route, self.gate_up, self.down, self._apart(x, self.tp.addend(h)), self.folded)
        return self.tp.reduce(out)

    def _forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        s = self.spec
        residual = self._apart(x, residual)
        logits = F.linear(x, self.router)
        out = self.ops.moe(x, logits, self.gate_up, self.down, s.top_k, s.norm_topk_prob, residual,
                           self.experts_read, self.folded)
        return self.tp.reduce(out)

    def _apart(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """The addend of the routed sum: the residual, plus the shared expert's term where it runs
        apart (not folded)."""
        if self.shared is None or self.shared_slots:
            return residual
        # HF: routed + sigmoid(gate) * shared, then the residual add; the shared term is added
        # first here so that the routed sum's kernel takes one addend.
        shared = self.shared.term(self.ops, x, F.linear(x, self.shared_gate))
        return shared if residual is None else residual + shared

    def routed_bytes(self) -> int:
        expert = self.gate_up[0].numel() * self.gate_up.element_size() + self.down[0].numel() * self.down.element_size()
        return int(self.experts_read) * expert

    def tensors(self) -> list[torch.Tensor]:
        """What a step reads whatever it routes: the router (with a folded shared expert's gate)
        and the shared expert. The routed experts are counted by ``experts_read``."""
        if self.shared is None:
            return [self.router]
        gate = [] if self.shared_slots else [self.shared_gate]
        return [self.router, self.shared.gate_up, self.shared.down, *gate]
