"""Dense SwiGLU FFN component: down(silu(gate(x)) * up(x)), gate and up fused into one GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale_cli.kernels.ops import Ops


class DenseSwiGluFfn:
    """x: (T, hidden) -> (T, hidden). ``gate_up``: (2I, hidden) = [gate; up], ``down``: (hidden, I)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, ops: Ops):
        self.gate_up = gate_up
        self.down = down
        self.ops = ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ops.silu_and_mul(F.linear(x, self.gate_up)), self.down)
