"""Dense SwiGLU FFN component: down(silu(gate(x)) * up(x)), gate and up fused into one GEMM."""

from __future__ import annotations

import torch

from metrale_cli.kernels.ops import Ops
from metrale_cli.layers.context import ForwardContext
from metrale_cli.layers.parallel import SINGLE, TensorParallel


class DenseSwiGluFfn:
    """An :class:`~metrale_cli.layers.protocols.FfnComponent`. ``gate_up``: (2I, hidden) =
    [gate; up], ``down``: (hidden, I); a tensor-parallel shard (``tp``) sums its output over the
    ranks (its row path with the residual that rank 0 alone adds)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, ops: Ops, tp: TensorParallel = SINGLE):
        self.gate_up = gate_up
        self.down = down
        self.ops, self.tp = ops, tp
        self.fuses_row = all(ops.gemv_fits(t.shape[1], t.dtype) for t in (gate_up, down))

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.tp.reduce(self.ops.linear(self.ops.linear_silu_and_mul(x, self.gate_up), self.down))

    def add_row(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """norm + gate/up + SwiGLU in one GEMV, down + the residual add in another."""
        act, _ = self.ops.gemv_norm_swiglu(h, None, norm_weight, eps, self.gate_up)
        return self.tp.reduce(self.ops.gemv_add(act, self.down, self.tp.addend(h)))

    def tensors(self) -> list[torch.Tensor]:
        return [self.gate_up, self.down]

    def routed_bytes(self) -> int:
        return 0
