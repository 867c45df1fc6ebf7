"""The cuda backend's MoE experts (:meth:`~metrale_cli.kernels.ops.Ops.moe`).

Up to ``MOE_DECODE_ROWS`` rows (decode steps, short chunks): moe.cu's three launches, which read
each chosen expert's weights once per call and keep the expert ids on the device. More rows
(prefill): the tokens sorted by expert and both expert projections as grouped GEMMs on tensor
cores (``torch._grouped_mm``, CUTLASS on sm_90), the weighted sum gathered back per token in slot
order. Neither syncs with the host, so both can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.cuda_launch import CudaLauncher, _ready
from metrale_cli.kernels.table import (
    MOE_DECODE_ROWS, MOE_DOWN, MOE_DOWN_COLS, MOE_GATE_UP, MOE_MAX_EXPERTS, MOE_MAX_PAIRS, MOE_MAX_TOP_K,
    MOE_ROUTE, MOE_STAGE_ELEMS, MOE_THREADS, MOE_WARPS,
)


def check_moe_shapes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int) -> None:
    """The shapes the kernels and grouped GEMMs serve: bf16, 8-element aligned rows."""
    experts, inter2, hidden = gate_up.shape
    if x.dtype != torch.bfloat16 or gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
        raise MetraleError(f"the cuda backend's MoE experts take bf16 activations and weights, not {x.dtype} / "
                           f"{gate_up.dtype}", hint="load the model in bf16, or use --backend torch")
    if hidden % 8 or inter2 % 16 or not 0 < hidden <= MOE_STAGE_ELEMS or inter2 // 2 > MOE_STAGE_ELEMS:
        raise MetraleError(f"the cuda backend's MoE experts need hidden and expert sizes that are multiples of 8 "
                           f"up to {MOE_STAGE_ELEMS}, not {hidden} and {inter2 // 2}", hint="use --backend torch")
    if not 0 < top_k <= min(experts, MOE_MAX_TOP_K) or experts > MOE_MAX_EXPERTS:
        raise MetraleError(f"the cuda backend's MoE routing serves up to {MOE_MAX_EXPERTS} experts and top-k "
                           f"{MOE_MAX_TOP_K}, not {experts} and {top_k}", hint="use --backend torch")


class CudaMoe:
    """The MoE part of ``CudaOps`` (mixed into it)."""

    def moe_route(self: CudaLauncher, logits, top_k, normalize):
        rows = logits.shape[0]
        if rows > MOE_DECODE_ROWS or rows * top_k > MOE_MAX_PAIRS:
            return ref.moe_route(logits, top_k, normalize)
        ids, weights, _ = self._route(logits, top_k, normalize, None)
        return ids, weights

    def _route(self: CudaLauncher, logits, top_k, normalize, experts_read):
        rows, experts = logits.shape
        dev = logits.device
        ids = torch.empty(rows, top_k, dtype=torch.int32, device=dev)
        weights = torch.empty(rows, top_k, dtype=torch.float32, device=dev)
        plan = torch.empty(2 + 2 * experts + rows * top_k, dtype=torch.int32, device=dev)
        threads = 32 * min(16, max(4, rows))
        self._launch(MOE_ROUTE, (1,), (threads,), _ready(logits.to(torch.bfloat16)), ids, weights, plan,
                     experts_read, rows, experts, top_k, int(bool(normalize)), pdl=True)
        return ids, weights, plan

    def moe(self: CudaLauncher, x, logits, gate_up, down, top_k, normalize, residual, experts_read):
        check_moe_shapes(x, gate_up, down, top_k)
        rows = x.shape[0]
        if rows == 0:
            return torch.empty_like(x) if residual is None else residual.clone()
        if rows <= MOE_DECODE_ROWS and rows * top_k <= MOE_MAX_PAIRS:
            return self._moe_rows(x, logits, gate_up, down, top_k, normalize, residual, experts_read)
        return _moe_grouped(self, x, logits, gate_up, down, top_k, normalize, residual, experts_read)

    def _moe_rows(self: CudaLauncher, x, logits, gate_up, down, top_k, normalize, residual, experts_read):
        rows, hidden = x.shape
        experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
        _, weights, plan = self._route(logits, top_k, normalize, experts_read)
        pairs, chosen = rows * top_k, min(experts, rows * top_k)
        x = _ready(x)
        act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        self._launch(MOE_GATE_UP, (math.ceil(inter / MOE_WARPS), chosen), (MOE_THREADS,), x,
                     _ready(gate_up), plan, act, hidden, inter, experts, top_k, pdl=True)
        y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
        out = torch.empty_like(x)
        ctas = math.ceil(hidden / (MOE_WARPS * MOE_DOWN_COLS))
        self._launch(MOE_DOWN, (ctas, chosen), (MOE_THREADS,), act, _ready(down), plan, weights, y,
                     None if residual is None else _ready(residual), out, self._moe_counters(x.device, ctas), rows,
                     hidden, inter, experts, top_k, pdl=True)
        return out

    def _moe_counters(self: CudaLauncher, device: torch.device, count: int) -> torch.Tensor:
        """Zeroed int32 words, one per column tile of moe_down_bf16, which leaves them zero: kept per
        device and grown (never shrunk) so graphs replay on the same buffer."""
        counters = self.__dict__.setdefault("_moe_counter_words", {})
        have = counters.get(device.index)
        if have is None or have.numel() < count:
            have = counters[device.index] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        return have


def _moe_grouped(ops, x, logits, gate_up, down, top_k, normalize, residual, experts_read):
    """Prefill: tokens sorted by expert (stable, so the order is the tokens'), gate/up and down as
    two grouped GEMMs over the experts' row groups, SwiGLU between them, then each token's slots
    weighted and summed in slot order."""
    rows, hidden = x.shape
    experts = gate_up.shape[0]
    ids, weights = ref.moe_route(logits, top_k, normalize)
    if experts_read is not None:
        ref.count_experts(ids, experts, experts_read)
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // top_k]
    act = ops.silu_and_mul(torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offsets))
    ys = torch._grouped_mm(act, down.transpose(1, 2), offs=offsets)
    y = torch.empty_like(ys)
    y[order] = ys
    y = y.view(rows, top_k, hidden) * weights.to(x.dtype)[..., None]
    out = y.float().sum(dim=1).to(x.dtype)
    return out if residual is None else residual + out
