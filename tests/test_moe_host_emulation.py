"""moe.cu emulated on the CPU against the torch reference of ``Ops.moe`` (kernels/reference.py).

``kernels_cu/host/moe_host.cpp`` runs the routing CTA and the expert grids as CudaOps launches
them, on the cases of ``tests/moe_cases.py``: 1, 7, 19, 33 and 64 rows; 6 to 1024 experts; top-k 1
to 8; experts chosen by no row, by one and by every row; exact ties in the logits; a shared
expert read in place as one to four chunks of the experts' width, the last one short. The
routing's ids must be torch.topk's as it runs on CUDA (equal probabilities in expert-id order),
the plan must list each chosen expert once with exactly the pairs that chose it, and the outputs
are held to the reference with the "moe" row.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from host_build import build_host_library
from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.tolerances import bounds
from metrale_cli.kernels.cuda_moe import router_ctas
from metrale_cli.kernels.table import MOE_ROUTER_CLUSTER
from moe_cases import (CASES, LANE_HEAVY, SHARED_CASES, case_id, lane_heavy_logits, moe_case, shared_case,
                        stable_route)

_LIB: list[ctypes.CDLL] = []


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    if not _LIB:
        handle = build_host_library("moe_host.cpp", tmp_path_factory.mktemp("moe"))
        handle.host_moe_route.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6
        handle.host_moe_experts.argtypes = [ctypes.c_void_p] * 12 + [ctypes.c_int] * 6
        handle.host_moe_experts_one.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int] * 5
        handle.host_moe_route_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6
        handle.host_moe_combine.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
        handle.host_moe_router.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int]
        _LIB.append(handle)
    return _LIB[0]


def _p(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def route(lib, logits, top_k, normalize, threads=128, shared=0):
    rows, experts = logits.shape[0], logits.shape[1] - (shared > 0)
    slots, total = top_k + shared, experts + shared
    ids = torch.full((rows, slots), -1, dtype=torch.int32)
    weights = torch.full((rows, slots), float("nan"))
    plan = torch.full((2 + 2 * total + rows * slots,), -7, dtype=torch.int32)
    read = torch.tensor([5], dtype=torch.long)
    lib.host_moe_route(_p(logits), _p(ids), _p(weights), _p(plan), _p(read), rows, experts, top_k, shared,
                       int(normalize), threads)
    return ids, weights, plan, int(read) - 5


def close(got, want, row):
    atol, rtol = bounds(row)
    err = (got.double() - want.double()).abs()
    assert bool((err <= atol + rtol * want.double().abs()).all()), f"{row}: max |err| {err.max().item():.3g}"


def _case(case, seed=0):
    """(tensors, shared chunks) of a CASES or SHARED_CASES entry."""
    if len(case) == 6:
        return moe_case(*case, seed=seed), 0
    t = shared_case(*case, seed=seed)
    return t, t["chunks"]


def experts(lib, t, plan, weights, residual, rows, top_k, shared=0):
    """host_moe_experts over a case's tensors (``top_k``: the row's slots, any shared among them)
    -> (out, counters after)."""
    experts, inter2, hidden = t["gate_up"].shape
    inter, sh = inter2 // 2, t.get("shared")
    act = torch.full((rows * top_k, inter), float("nan"), dtype=torch.bfloat16)
    y = torch.full((rows * top_k, hidden), float("nan"))
    out = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16)
    counters = torch.zeros(hidden, dtype=torch.int32)
    lib.host_moe_experts(_p(t["x"]), _p(t["gate_up"]), _p(t["down"]), _p(sh and sh.gate_up), _p(sh and sh.down),
                         _p(plan), _p(weights), _p(residual), _p(act), _p(y), _p(out), _p(counters), rows, hidden,
                         inter, sh.width if shared else 0, experts + shared, top_k)
    return out, counters


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("case", CASES + SHARED_CASES, ids=case_id)
def test_routing_is_torch_topk_and_the_plan_lists_every_pair_once(lib, case, normalize):
    """The routed slots as torch.topk takes them; shared chunk slots after them, every row's,
    weighted sigmoid(the shared gate's logit); the plan over routed and shared experts: in id order,
    and for one row in slot order (entry s: slot s's expert and pair)."""
    rows, experts, top_k = case[:3]
    t, shared = _case(case)
    ids, weights, plan, read = route(lib, t["logits"], top_k, normalize, shared=shared)
    want_ids, want_w = stable_route(t["logits"], top_k, normalize, shared)
    assert torch.equal(ids, want_ids)
    close(weights, want_w, "moe route")
    chosen = want_ids[0].tolist() if rows == 1 else sorted(set(want_ids.flatten().tolist()))
    n, total = int(plan[0]), experts + shared
    assert n == len(chosen) and read == n - shared  # the routed experts read
    assert plan[1:1 + n].tolist() == chosen
    offsets = plan[1 + total:2 + total + n].tolist()
    pairs = plan[2 + 2 * total:].tolist()
    assert offsets[0] == 0 and offsets[-1] == rows * (top_k + shared)
    flat = want_ids.flatten().tolist()
    for slot, e in enumerate(chosen):
        assert sorted(pairs[offsets[slot]:offsets[slot + 1]]) == [q for q, x in enumerate(flat) if x == e]


@pytest.mark.parametrize("rows, experts, top_k, pattern", [(7, 16, 4, "ties"), (5, 512, 10, "ties"),
                                                           (5, 128, 8, "random"), (3, 60, 4, "few")])
def test_batch_one_routing_equals_the_rows_routing(lib, rows, experts, top_k, pattern):
    """A row routed alone (every expert ranked at once) gets the ids and weights, bit for bit, that
    it gets among other rows (a warp's k rounds of arg-max)."""
    t = moe_case(rows, experts, top_k, 64, 16, pattern, seed=4)
    for normalize in (True, False):
        ids, weights, _, _ = route(lib, t["logits"], top_k, normalize)
        for r in range(rows):
            one_ids, one_w, _, _ = route(lib, t["logits"][r:r + 1].contiguous(), top_k, normalize, threads=256)
            assert torch.equal(one_ids, ids[r:r + 1]) and torch.equal(one_w, weights[r:r + 1])


@pytest.mark.parametrize("normalize", [True, False])
def test_logits_of_either_sign_of_zero_tie(lib, normalize):
    """The routing ranks logits, not probabilities: -0 and +0 give equal probabilities, so they
    tie, and the lower expert id comes first whichever sign it holds; negative logits rank below
    them. The weights are the softmax's."""
    logits = torch.full((2, 40), -3.0)
    logits[:, 2] = 1.5
    logits[0, 4], logits[0, 37] = -0.0, 0.0
    logits[1, 4], logits[1, 37] = 0.0, -0.0
    logits[:, 9] = -0.25
    logits = logits.bfloat16()
    ids, weights, _, _ = route(lib, logits, 3, normalize)
    want_ids, want_w = stable_route(logits, 3, normalize)
    assert ids.tolist() == [[2, 4, 37], [2, 4, 37]] == want_ids.tolist()
    close(weights, want_w, "moe route")


@pytest.mark.parametrize("experts, top_k", LANE_HEAVY)
def test_routing_takes_a_lanes_every_expert_in_turn(lib, experts, top_k):
    """One lane gives several slots in a row and runs out of experts (lane_heavy_logits), at every
    count of experts a lane holds: the ids are torch.topk's (equal logits in id order), a row's the
    same alone (batch 1's path) and in the batch."""
    logits = lane_heavy_logits(experts)
    for normalize in (True, False):
        ids, weights, _, _ = route(lib, logits, top_k, normalize)
        want_ids, want_w = stable_route(logits, top_k, normalize)
        assert torch.equal(ids, want_ids)
        close(weights, want_w, "moe route")
        for r in range(logits.shape[0]):
            one_ids, one_w, _, _ = route(lib, logits[r:r + 1].contiguous(), top_k, normalize, threads=256)
            assert torch.equal(one_ids, ids[r:r + 1]) and torch.equal(one_w, weights[r:r + 1])


def test_routing_runs_rows_on_fewer_warps_than_rows(lib):
    t = moe_case(33, 12, 3, 64, 32, "random", seed=3)
    ids, _, _, _ = route(lib, t["logits"], 3, True, threads=64)
    assert torch.equal(ids, stable_route(t["logits"], 3, True)[0])


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("case", CASES + SHARED_CASES, ids=case_id)
def test_experts_equal_the_reference(lib, case, with_residual):
    rows, top_k = case[0], case[2]
    t, shared = _case(case, seed=1)
    ids, weights, plan, _ = route(lib, t["logits"], top_k, True, shared=shared)
    residual = t["residual"] if with_residual else None
    out, counters = experts(lib, t, plan, weights, residual, rows, top_k + shared, shared)
    gate_up, down = ref.shared_chunks(t["gate_up"], t["down"], t.get("shared"))  # chunks zero-padded
    want = ref.moe_experts(t["x"].float(), ids, weights, gate_up.float(), down.float(),
                           None if residual is None else residual.float())
    close(out.float(), want, "moe")
    assert not counters.any()  # left zero for the next launch


# the last two: an expert's K (inter, and the shared expert's width) in five to nine 64-wide blocks,
# the last one short, so that all four warps of an expert have blocks to sum
ONE_ROW = [c for c in CASES + SHARED_CASES if c[0] == 1] + [(1, 64, 32, 72, 16, "random"), (1, 8, 2, 200, 48, "all", 88),
                                                             (1, 16, 4, 72, 328, "random"), (1, 8, 2, 136, 264, "random", 520)]


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("case", ONE_ROW, ids=case_id)
def test_batch_one_down_in_one_cta_equals_moe_down(lib, case, with_residual):
    """moe_down_one_bf16 (batch 1: a CTA takes every slot of its column tile) gives moe_down_bf16's
    out bit for bit: K split in the same warps, summed in the same order, the slots in slot order.
    32 slots (the most it takes) need four rounds of its warps; 200 columns a short last tile; K of
    five to nine blocks gives each of an expert's four warps blocks of its own to sum."""
    t, shared = _case(case, seed=5)
    top_k, slots = case[2], case[2] + shared
    ids, weights, plan, _ = route(lib, t["logits"], top_k, True, shared=shared)
    residual = t["residual"] if with_residual else None
    want, _ = experts(lib, t, plan, weights, residual, 1, slots, shared)
    experts_, inter2, hidden = t["gate_up"].shape
    sh = t.get("shared")
    act = torch.full((slots, inter2 // 2), float("nan"), dtype=torch.bfloat16)
    out = torch.full((1, hidden), float("nan"), dtype=torch.bfloat16)
    lib.host_moe_experts_one(_p(t["x"]), _p(t["gate_up"]), _p(t["down"]), _p(sh and sh.gate_up), _p(sh and sh.down),
                             _p(plan), _p(weights), _p(residual), _p(act), _p(out), hidden, inter2 // 2,
                             sh.width if sh else 0, experts_ + shared, slots)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_a_row_is_the_same_alone_and_in_a_batch(lib):
    case = (7, 16, 4, 64, 24, "random")
    t = moe_case(*case, seed=2)
    outs = []
    for rows in (slice(0, 7), slice(3, 4)):
        x, logits = t["x"][rows].contiguous(), t["logits"][rows].contiguous()
        n = x.shape[0]
        _, weights, plan, _ = route(lib, logits, 4, True)
        outs.append(experts(lib, dict(t, x=x), plan, weights, None, n, 4)[0])
    assert torch.equal(outs[0][3:4], outs[1])


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("case", CASES + SHARED_CASES, ids=case_id)
def test_prefill_routing_is_torch_topk_and_counts_every_pair(lib, case, normalize):
    """moe_route_rows_bf16, a warp per row over CTAs of 2 warps: the decode routing's ids and
    weights, and each expert's number of pairs (shared chunks: every row)."""
    rows, experts, top_k = case[:3]
    t, shared = _case(case)
    ids = torch.full((rows, top_k + shared), -1, dtype=torch.int32)
    weights = torch.full((rows, top_k + shared), float("nan"))
    counts = torch.zeros(experts + shared, dtype=torch.int32)
    lib.host_moe_route_rows(_p(t["logits"]), _p(ids), _p(weights), _p(counts), rows, experts, top_k, shared,
                            int(normalize), 64)
    want_ids, want_w = stable_route(t["logits"], top_k, normalize, shared)
    assert torch.equal(ids, want_ids)
    close(weights, want_w, "moe route")
    want_counts = torch.bincount(want_ids.flatten(), minlength=experts + shared).to(torch.int32)
    assert torch.equal(counts, want_counts)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 8), (7, 4, 1288), (33, 8, 64), (5, 3, 2056)])
def test_prefill_combine_weights_and_sums_each_rows_slots_in_order(lib, shape, with_residual):
    """moe_combine_bf16: out[r] = bf16(sum in slot order of bf16(ys[where[r, s]] * bf16(w[r, s])))
    [then bf16(residual + that)], bit for bit, with ys in a shuffled (grouped) order and hidden
    sizes that leave threads idle or loop."""
    rows, top_k, hidden = shape
    g = torch.Generator().manual_seed(rows * 31 + hidden)
    pairs = rows * top_k
    ys = torch.randn(pairs, hidden, generator=g).to(torch.bfloat16)
    where = torch.randperm(pairs, generator=g).to(torch.int32)
    weights = torch.rand(rows, top_k, generator=g)
    residual = torch.randn(rows, hidden, generator=g).to(torch.bfloat16) if with_residual else None
    out = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16)
    lib.host_moe_combine(_p(ys), _p(where), _p(weights), _p(residual), _p(out), rows, hidden, top_k, 128)
    y = ys[where.long()].view(rows, top_k, hidden)
    w = weights.to(torch.bfloat16)
    want = torch.zeros(rows, hidden)
    for s in range(top_k):  # fp32 adds in slot order
        want += (y[:, s] * w[:, s, None]).float()
    want = want.to(torch.bfloat16)
    if residual is not None:
        want = residual + want
    assert torch.equal(out, want)


@pytest.fixture(scope="module")
def gemv_lib(tmp_path_factory) -> ctypes.CDLL:
    """gemv.cu and rmsnorm.cu emulated: the kernels moe_router_bf16 must equal bit for bit."""
    handle = build_host_library("gemv_host.cpp", tmp_path_factory.mktemp("gemv"))
    handle.host_gemv.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 2 + [ctypes.c_float,
                                                                                                ctypes.c_int]
    handle.host_norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_float]
    return handle


ROUTER_CASES = [(128, 8, 2048, 0), (60, 4, 1000, 0), (6, 2, 8, 0), (512, 10, 4096, 0), (33, 1, 2056, 0),
                (512, 10, 2048, 1), (60, 4, 1000, 4), (7, 2, 8, 1)]


# the cases whose grid CudaOps launches as one cluster (2 to MOE_ROUTER_CLUSTER CTAs)
CLUSTER_CASES = [c for c in ROUTER_CASES if 1 < router_ctas(c[0] + (c[3] > 0)) <= MOE_ROUTER_CLUSTER]


@pytest.mark.parametrize("experts, top_k, hidden, shared, cluster",
                         [(*c, False) for c in ROUTER_CASES] + [(*c, True) for c in CLUSTER_CASES])
def test_fused_router_equals_norm_gemv_and_route(lib, gemv_lib, experts, top_k, hidden, shared, cluster):
    """moe_router_bf16 (batch 1): its x is rms_norm_bf16's row, its logits gemv_norm_bf16's
    (the router as the weight: both prologue block sizes, rows of one and of two load batches, a
    CTA's warps partly idle; with shared slots one more row, the shared gate), and its route
    moe_route_bf16's on those logits: ids, weights, plan, experts_read. Over more CTAs than one
    cluster the last routes once it has loaded every logit; the logit words, pending (0xffff) before,
    are left pending for the next launch, which runs on them again here. As one cluster (CudaOps's
    launch up to 16 CTAs: 128 experts, 60 with or without the gate) CTA 0 routes from the logits
    gathered from the CTAs' shared memory, which are not stored."""
    rows = experts + (shared > 0)
    g = torch.Generator().manual_seed(experts + hidden)
    h = (torch.randn(1, hidden, generator=g) * 3).to(torch.bfloat16)
    gamma = (1 + torch.randn(hidden, generator=g) * 0.1).to(torch.bfloat16)
    router = (torch.randn(rows, hidden, generator=g) * hidden ** -0.5).to(torch.bfloat16)
    logits = torch.full((1, rows), -1, dtype=torch.int16)
    want_x = torch.full_like(h, float("nan"))
    gemv_lib.host_norm(_p(h), None, _p(gamma), _p(want_x), None, hidden, 1e-6)
    want_logits = torch.full((1, rows), float("nan"), dtype=torch.bfloat16)
    gemv_lib.host_gemv(0, _p(router), _p(h), None, _p(gamma), None, _p(want_logits), rows, hidden, 1e-6, 5)
    want_ids, want_w, want_plan, want_read = route(lib, want_logits, top_k, True, shared=shared)
    for _ in range(2):
        x = torch.full_like(h, float("nan"))
        ids = torch.full((1, top_k + shared), -1, dtype=torch.int32)
        weights = torch.full((1, top_k + shared), float("nan"))
        plan = torch.full((2 + 2 * (experts + shared) + top_k + shared,), -7, dtype=torch.int32)
        read = torch.tensor([5], dtype=torch.long)
        lib.host_moe_router(_p(router), _p(h), _p(gamma), _p(x), _p(logits), _p(ids), _p(weights), _p(plan),
                            _p(read), experts, hidden, top_k, shared, 1, 1e-6, int(cluster))
        assert torch.equal(x.view(torch.int16), want_x.view(torch.int16))
        assert bool((logits == -1).all())
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
        assert torch.equal(plan, want_plan) and int(read) - 5 == want_read
