"""The cuda backend's MoE experts (:meth:`~metrale_cli.kernels.ops.Ops.moe`).

Up to ``MOE_DECODE_ROWS`` rows (decode steps, short chunks): moe.cu's three launches, which read
each chosen expert's weights once per call (their dot products on tensor cores) and keep the
expert ids on the device; at batch 1 (:meth:`CudaMoe.moe_norm_route`) the FFN's norm, the router's
GEMV and the routing are one more launch, moe_router_bf16, in place of three, and the down
projection takes every slot of a column tile in one CTA (moe_down_one_bf16), and gate/up keeps more
of a warp's weight loads in flight where its grid is one wave (moe_gate_up_one_bf16). More rows
(prefill): moe.cu routes the rows, the tokens are sorted by expert, both expert projections run as
grouped GEMMs on tensor cores (``torch._grouped_mm``, CUTLASS on sm_90), and moe.cu gathers each
token's weighted sum back in slot order. Neither syncs with the host, so both can be captured in a CUDA graph.

A shared expert (:class:`~metrale_cli.kernels.ops.SharedExpert`) rides along in the decode
launches as chunks of the experts' width that every row is routed to, read in place; the grouped
path runs it apart, in HF's order (its gated output added to the residual first).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import cuda_launch
from metrale_cli.kernels.cuda_launch import CudaLauncher, _ready
from metrale_cli.kernels.loader import clusters_available
from metrale_cli.kernels.ops import MoeRoute, SharedExpert
from metrale_cli.kernels.table import (
    GEMV_THREADS, MOE_COMBINE, MOE_DECODE_ROWS, MOE_DOWN, MOE_DOWN_ONE, MOE_DOWN_ONE_SLOTS, MOE_DOWN_ONE_THREADS,
    MOE_GATE_UP, MOE_GATE_UP_ONE, MOE_GATE_UP_ONE_PER_SM, MOE_MAX_EXPERTS, MOE_MAX_PAIRS, MOE_MAX_TOP_K,
    MOE_ROUTE, MOE_ROUTE_ROWS, MOE_ROUTER, MOE_ROUTER_CLUSTER, MOE_TC_ROWS, MOE_TC_THREADS, MOE_THREADS, MOE_WARPS,
)

GEMV_WARPS = GEMV_THREADS // 32  # moe_router_bf16: a warp per expert


def router_ctas(router_rows: int) -> int:
    """The CTAs of a batch-1 router launch (moe_router_bf16): a warp per router row."""
    return math.ceil(router_rows / GEMV_WARPS)


def router_cluster(device: torch.device, ctas: int) -> int:
    """The cluster size of a batch-1 router launch of ``ctas`` CTAs: the whole grid, so that its
    first CTA routes from the logits in the CTAs' shared memory, when it has 2 to
    MOE_ROUTER_CLUSTER CTAs; else 1 (the last CTA routes, by counter, from the logits in L2)."""
    return ctas if 1 < ctas <= MOE_ROUTER_CLUSTER and clusters_available(device.index) else 1


def check_moe_shapes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                     shared: SharedExpert | None = None) -> None:
    """The shapes the kernels and grouped GEMMs serve: bf16, 8-element aligned rows (``top_k``: the
    slots of a row that the experts take)."""
    experts, inter2, hidden = gate_up.shape
    tensors = (gate_up, down) if shared is None else (gate_up, down, shared.gate_up, shared.down)
    if x.dtype != torch.bfloat16 or any(t.dtype != torch.bfloat16 for t in tensors):
        raise MetraleError(f"the cuda backend's MoE experts take bf16 activations and weights, not {x.dtype} / "
                           f"{gate_up.dtype}", hint="load the model in bf16, or use --backend torch")
    width = 0 if shared is None else shared.width
    if hidden % 8 or inter2 % 16 or width % 8 or not hidden:
        raise MetraleError(f"the cuda backend's MoE experts need hidden and expert sizes that are multiples of 8, "
                           f"not {hidden}, {inter2 // 2} and a shared expert of {width}", hint="use --backend torch")
    total = experts + (0 if shared is None else shared.chunks(inter2 // 2))
    if not 0 < top_k <= min(total, MOE_MAX_TOP_K) or total > MOE_MAX_EXPERTS:
        raise MetraleError(f"the cuda backend's MoE routing serves up to {MOE_MAX_EXPERTS} experts and top-k "
                           f"{MOE_MAX_TOP_K}, not {total} and {top_k}", hint="use --backend torch")


class CudaMoe:
    """The MoE part of ``CudaOps`` (mixed into it)."""

    def moe_route(self: CudaLauncher, logits, top_k, normalize, shared=0):
        route = self._routes(logits, top_k, normalize, None, shared, False)
        return route.ids, route.weights

    def _routes(self: CudaLauncher, logits, top_k, normalize, experts_read, shared, apart=True) -> MoeRoute:
        """Decode rows: moe_route_bf16 (the ids, weights and the experts' plan, with the ``shared``
        slots); more rows: a warp per row (the ids, weights and each expert's count), where with
        ``apart`` the shared expert is left to run apart (the grouped GEMMs have no chunk of it:
        the route keeps its gate's logits). ``experts_read`` counts the routed experts."""
        rows = logits.shape[0]
        if _decode_rows(rows, top_k + shared):
            return MoeRoute(*self._route(logits, top_k, normalize, experts_read, shared))
        experts, gate = _routed(logits.shape[1], shared), None
        if shared and apart:
            logits, gate = logits[:, :experts], logits[:, experts:]
        ids, weights, counts = _route_rows(self, logits, top_k, normalize, 0 if gate is not None else shared)
        if experts_read is not None:
            experts_read += (counts[:experts] > 0).sum()
        return MoeRoute(ids, weights, counts=counts, gate=gate)

    def _route_buffers(self: CudaLauncher, rows, experts, slots, dev):
        """(ids, weights, plan) for moe_route_bf16 and moe_router_bf16 to fill (``experts`` and
        ``slots`` a row's: shared chunks counted)."""
        return (torch.empty(rows, slots, dtype=torch.int32, device=dev),
                torch.empty(rows, slots, dtype=torch.float32, device=dev),
                torch.empty(2 + 2 * experts + rows * slots, dtype=torch.int32, device=dev))

    def _route(self: CudaLauncher, logits, top_k, normalize, experts_read, shared):
        rows, experts = logits.shape[0], _routed(logits.shape[1], shared)
        ids, weights, plan = self._route_buffers(rows, experts + shared, top_k + shared, logits.device)
        threads = 32 * min(16, max(4, rows))
        self._launch(MOE_ROUTE, (1,), (threads,), _ready(logits.to(torch.bfloat16)), ids, weights, plan,
                     experts_read, rows, experts, top_k, shared, int(bool(normalize)), pdl=True)
        return ids, weights, plan

    def moe(self: CudaLauncher, x, logits, gate_up, down, top_k, normalize, residual, experts_read, shared=None):
        check_moe_shapes(x, gate_up, down, top_k, shared)
        if x.shape[0] == 0:
            return torch.empty_like(x) if residual is None else residual.clone()
        slots = 0 if shared is None else shared.chunks(gate_up.shape[1] // 2)
        route = self._routes(logits, top_k, normalize, experts_read, slots)
        return self.moe_routed(x, route, gate_up, down, residual, shared)

    def moe_norm_route(self: CudaLauncher, h, norm_weight, eps, router, top_k, normalize, experts_read, shared=0):
        rows, hidden = h.shape
        experts = _routed(router.shape[0], shared)
        fused = (rows == 1 and self.gemv_fits(hidden, router.dtype) and h.dtype == router.dtype
                 and 0 < top_k <= min(experts, MOE_MAX_TOP_K) and experts + shared <= MOE_MAX_EXPERTS)
        if not fused:
            x = self.rms_norm(h, norm_weight, eps)
            return x, self._routes(F.linear(x, router), top_k, normalize, experts_read, shared)
        dev = h.device
        x = torch.empty_like(h)
        ids, weights, plan = self._route_buffers(1, experts + shared, top_k + shared, dev)
        grid = router_ctas(router.shape[0])
        self._launch(MOE_ROUTER, (grid,), (GEMV_THREADS,), _ready(router),
                     _ready(h), _ready(norm_weight), x, self._pending_logits(dev, router.shape[0]), ids, weights, plan,
                     experts_read, experts, hidden, top_k, shared, int(bool(normalize)), eps,
                     pdl=True, cluster=(router_cluster(dev, grid), 1, 1))
        return x, MoeRoute(ids, weights, plan)

    def moe_routed(self: CudaLauncher, x, route: MoeRoute, gate_up, down, residual, shared=None):
        check_moe_shapes(x, gate_up, down, route.ids.shape[1], shared)
        if x.shape[0] == 0:
            return torch.empty_like(x) if residual is None else residual.clone()
        if route.plan is not None:
            return self._moe_rows(x, route, gate_up, down, residual, shared)
        if shared is not None:  # HF's order: the shared expert's gated output added to the residual first
            term = shared.term(self, x, route.gate)
            residual = term if residual is None else residual + term
        return _moe_grouped(self, x, route, gate_up, down, residual)

    def _moe_rows(self: CudaLauncher, x, route: MoeRoute, gate_up, down, residual, shared):
        rows, hidden = x.shape
        top_k = route.ids.shape[1]  # the row's slots, any shared chunks' among them
        inter = gate_up.shape[1] // 2
        width = 0 if shared is None else shared.width
        experts = gate_up.shape[0] + (0 if shared is None else shared.chunks(inter))
        pairs, chosen = rows * top_k, min(experts, rows * top_k)
        x = _ready(x)
        act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        out = torch.empty_like(x)
        gate_up_ctas, down_ctas = math.ceil(inter / MOE_TC_ROWS), math.ceil(hidden / MOE_TC_ROWS)
        shared_gate_up, shared_down = (None, None) if shared is None else (_ready(shared.gate_up), _ready(shared.down))
        # down's own inputs made ready before gate/up launches: batch 1's down reads its weights, the
        # plan, the weights of the slots and the residual before its wait, so no copy may run between
        down, residual = _ready(down), None if residual is None else _ready(residual)
        # batch 1 where its grid is one wave of its CTAs: its act bit for bit, more loads in flight a warp
        one = rows == 1 and gate_up_ctas * chosen <= MOE_GATE_UP_ONE_PER_SM * cuda_launch._sm_count(x.device.index)
        gate_up_kernel = MOE_GATE_UP_ONE if one else MOE_GATE_UP
        self._launch(gate_up_kernel, (gate_up_ctas, chosen), (MOE_TC_THREADS,), x, _ready(gate_up), shared_gate_up,
                     route.plan, act, hidden, inter, width, experts, top_k, pdl=True)
        if rows == 1 and top_k <= MOE_DOWN_ONE_SLOTS:  # every slot's expert of a column tile in one CTA
            self._launch(MOE_DOWN_ONE, (down_ctas,), (MOE_DOWN_ONE_THREADS,), act, down, shared_down,
                         route.plan, route.weights, residual, out, hidden, inter, width, experts, top_k, pdl=True)
            return out
        y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
        self._launch(MOE_DOWN, (down_ctas, chosen), (MOE_TC_THREADS,), act, down, shared_down, route.plan,
                     route.weights, y, residual, out, self._moe_counters(x.device, down_ctas), rows, hidden, inter,
                     width, experts, top_k, pdl=True)
        return out

    def _moe_counters(self: CudaLauncher, device: torch.device, count: int) -> torch.Tensor:
        """Zeroed int32 words, one per column tile of moe_down_bf16, which leaves them zero."""
        return _kept_words(self, device, "down", count, torch.int32, 0)

    def _pending_logits(self: CudaLauncher, device: torch.device, count: int) -> torch.Tensor:
        """moe_router_bf16's logit words, each LOGIT_PENDING (0xffff), which it leaves so (the
        cluster launch does not touch them)."""
        return _kept_words(self, device, "router logits", count, torch.int16, -1).view(torch.bfloat16)


def _kept_words(ops: CudaLauncher, device: torch.device, user: str, count: int, dtype: torch.dtype,
                fill: int) -> torch.Tensor:
    """At least ``count`` words of ``fill`` that the kernels of ``user`` leave as they found them: kept
    per device and user and grown (never shrunk) so graphs replay on the same buffer."""
    kept = ops.__dict__.setdefault("_moe_kept_words", {})
    have = kept.get((device.index, user))
    if have is None or have.numel() < count:
        have = kept[device.index, user] = torch.full((max(count, MOE_MAX_EXPERTS + 1),), fill, dtype=dtype,
                                                     device=device)
    return have


def _decode_rows(rows: int, slots: int) -> bool:
    """Rows that moe.cu's decode launches serve (else the grouped GEMMs)."""
    return rows <= MOE_DECODE_ROWS and rows * slots <= MOE_MAX_PAIRS


def _routed(logit_columns: int, shared: int) -> int:
    """The routed experts of a router's logits: one column fewer with shared slots (the shared gate's)."""
    experts = logit_columns - (shared > 0)
    if shared < 0 or experts < 1:
        raise ValueError(f"{logit_columns} router logits cannot hold {shared} shared slots")
    return experts


def _route_rows(ops, logits, top_k, normalize, shared):
    """A warp per row (moe.cu): ids (rows, k + shared) int32, weights (rows, k + shared) fp32 and
    each expert's count of pairs (E + shared,) int32."""
    rows, experts = logits.shape[0], _routed(logits.shape[1], shared)
    dev = logits.device
    ids = torch.empty(rows, top_k + shared, dtype=torch.int32, device=dev)
    weights = torch.empty(rows, top_k + shared, dtype=torch.float32, device=dev)
    counts = torch.zeros(experts + shared, dtype=torch.int32, device=dev)
    ops._launch(MOE_ROUTE_ROWS, (math.ceil(rows / MOE_WARPS),), (MOE_THREADS,), _ready(logits.to(torch.bfloat16)),
                ids, weights, counts, rows, experts, top_k, shared, int(bool(normalize)), pdl=True)
    return ids, weights, counts


def _moe_grouped(ops, x, route: MoeRoute, gate_up, down, residual):
    """Prefill: each row routed by a warp (moe.cu, :meth:`CudaMoe._routes`), the pairs sorted by
    expert (stable, so the order is the tokens'), gate/up and down as two grouped GEMMs over the
    experts' row groups, SwiGLU between them, then each row's slots found in the grouped order,
    weighted and summed in slot order (moe.cu)."""
    rows, hidden = x.shape
    dev = x.device
    ids, weights, counts = route.ids, route.weights, route.counts
    top_k = ids.shape[1]
    order = torch.argsort(ids.flatten(), stable=True)
    pairs = rows * top_k
    where = torch.empty(pairs, dtype=torch.int32, device=dev).scatter_(
        0, order, torch.arange(pairs, dtype=torch.int32, device=dev))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // top_k]
    act = ops.silu_and_mul(torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offsets))
    ys = torch._grouped_mm(act, down.transpose(1, 2), offs=offsets)
    out = torch.empty_like(x)
    ops._launch(MOE_COMBINE, (rows,), (MOE_THREADS,), ys, where, weights,
                None if residual is None else _ready(residual), out, hidden, top_k, pdl=True)
    return out
