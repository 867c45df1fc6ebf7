"""The cuda backend's MoE experts (kernels/cuda_moe.py, moe.cu) against the torch reference, on an H200.

The cases of ``tests/moe_cases.py`` run moe.cu's launches (1 to 64 rows); 99 and 989 rows run the
grouped-GEMM prefill path. Outputs are held to ``TorchOps.moe`` in fp32 from the same bf16
inputs with the "moe" row; the routing must take torch.topk's values exactly, in expert-id order
where they tie (torch.topk's own tie order is unspecified). A row's result must not depend on the
rest of its batch, neither path may wait for the GPU, and a CUDA graph of the decode path must
replay it.
"""

from __future__ import annotations

import pytest
import torch

from metrale_cli.kernels import cuda_moe, reference as ref
from metrale_cli.kernels.ops import SharedExpert
from metrale_cli.kernels.tolerances import bounds
from moe_cases import (CASES, LANE_HEAVY, SHARED_CASES, case_id, lane_heavy_logits, moe_case, shared_case,
                        stable_route)

pytestmark = pytest.mark.gpu

PREFILL = [(99, 60, 4, 64, 24, "random"), (989, 128, 8, 256, 64, "random"), (99, 16, 4, 64, 24, "few")]
SHARED_PREFILL = [(99, 60, 4, 64, 24, "random", 96), (200, 512, 10, 128, 32, "random", 40)]


def _case(case, seed=0):
    """(tensors on the GPU, shared chunks) of a case with or without a shared expert."""
    if len(case) == 6:
        return moe_case(*case, seed=seed, device="cuda"), 0
    t = shared_case(*case, seed=seed, device="cuda")
    return t, t["chunks"]


def close(got, want, row):
    atol, rtol = bounds(row)
    err = (got.double() - want.double()).abs()
    assert bool((err <= atol + rtol * want.double().abs()).all()), f"{row}: max |err| {err.max().item():.3g}"


def _reference(t, top_k, normalize, residual):
    """TorchOps.moe in fp32 on the case's bf16 inputs (a shared expert's chunks stacked, padded)."""
    shared = t.get("shared")
    if shared is not None:
        shared = SharedExpert(shared.gate_up.float(), shared.down.float())
    return ref.moe(t["x"].float(), t["logits"], t["gate_up"].float(), t["down"].float(), top_k, normalize,
                   None if residual is None else residual.float(), None, shared)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("case", CASES + SHARED_CASES, ids=case_id)
def test_routing_takes_torch_topk_values_in_expert_id_order(ops, case, normalize):
    """torch.topk's values, in its order; among equal probabilities the lower expert id first
    (torch.topk orders ties arbitrarily, on CUDA as on the CPU: the 'ties' and 'all' cases); then
    any shared chunks, weighted sigmoid(the shared gate's logit)."""
    t, shared = _case(case)
    k, experts = case[2], case[1]
    ids, weights = ops.moe_route(t["logits"], k, normalize, shared)
    probs = torch.softmax(t["logits"][:, :experts], dim=-1, dtype=torch.float32)
    assert torch.equal(probs.gather(1, ids[:, :k].long()), torch.topk(probs, k).values)
    want_ids, want_w = stable_route(t["logits"], k, normalize, shared)
    assert torch.equal(ids, want_ids)
    close(weights, want_w, "moe route")


@pytest.mark.parametrize("normalize", [True, False])
def test_logits_of_either_sign_of_zero_tie(ops, normalize):
    """-0 and +0 logits give equal probabilities: the lower expert id first, whichever sign it
    holds (the routing ranks logits); negative logits below them."""
    logits = torch.full((2, 40), -3.0)
    logits[:, 2] = 1.5
    logits[0, 4], logits[0, 37] = -0.0, 0.0
    logits[1, 4], logits[1, 37] = 0.0, -0.0
    logits[:, 9] = -0.25
    logits = logits.bfloat16().cuda()
    ids, weights = ops.moe_route(logits, 3, normalize, 0)
    want_ids, want_w = stable_route(logits, 3, normalize)
    assert ids.tolist() == [[2, 4, 37], [2, 4, 37]] == want_ids.tolist()
    close(weights, want_w, "moe route")


@pytest.mark.parametrize("experts, top_k", LANE_HEAVY)
def test_routing_takes_a_lanes_every_expert_in_turn(ops, experts, top_k):
    """One lane gives several slots in a row and runs out of experts (lane_heavy_logits): torch.topk's
    ids, equal logits in id order; each row alone (batch 1) as in the batch, bit for bit."""
    logits = lane_heavy_logits(experts, "cuda")
    for normalize in (True, False):
        ids, weights = ops.moe_route(logits, top_k, normalize, 0)
        want_ids, want_w = stable_route(logits, top_k, normalize)
        assert torch.equal(ids, want_ids)
        close(weights, want_w, "moe route")
        for r in range(logits.shape[0]):
            one_ids, one_w = ops.moe_route(logits[r:r + 1].contiguous(), top_k, normalize, 0)
            assert torch.equal(one_ids, ids[r:r + 1]) and torch.equal(one_w, weights[r:r + 1])


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("case", CASES + PREFILL + SHARED_CASES + SHARED_PREFILL, ids=case_id)
def test_moe_equals_the_reference(ops, case, with_residual):
    top_k = case[2]
    t, shared = _case(case, seed=1)
    residual = t["residual"] if with_residual else None
    read = torch.zeros(1, dtype=torch.long, device="cuda")
    got = ops.moe(t["x"], t["logits"], t["gate_up"], t["down"], top_k, True, residual, read, t.get("shared"))
    close(got.float(), _reference(t, top_k, True, residual), "moe")
    assert int(read) == len(torch.unique(ref.moe_route(t["logits"], top_k, True, shared)[0][:, :top_k]))


@pytest.mark.parametrize("case", [CASES[4], CASES[6], PREFILL[0]], ids=case_id)
def test_a_row_does_not_depend_on_its_batch(ops, case):
    t = moe_case(*case, seed=2, device="cuda")
    k = case[2]
    whole = ops.moe(t["x"], t["logits"], t["gate_up"], t["down"], k, True, None, None)
    for r in (0, case[0] // 2, case[0] - 1):
        alone = ops.moe(t["x"][r:r + 1], t["logits"][r:r + 1], t["gate_up"], t["down"], k, True, None, None)
        if case[0] <= 64:
            assert torch.equal(whole[r:r + 1], alone)  # the same launches, the row's own sums
        else:
            close(alone.float(), whole[r:r + 1].float(), "moe")  # tensor-core tiles differ with M


@pytest.mark.parametrize("case", [CASES[1], PREFILL[0]], ids=case_id)
def test_moe_never_waits_for_the_gpu(ops, case):
    t = moe_case(*case, device="cuda")
    read = torch.zeros(1, dtype=torch.long, device="cuda")
    args = (t["x"], t["logits"], t["gate_up"], t["down"], case[2], True, t["residual"], read)
    want = ops.moe(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = ops.moe(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)


def test_a_cuda_graph_replays_the_decode_path(ops):
    case = CASES[6]
    t = moe_case(*case, device="cuda")
    x = t["x"].clone()
    logits = t["logits"].clone()
    read = torch.zeros(1, dtype=torch.long, device="cuda")
    ops.moe(x, logits, t["gate_up"], t["down"], 8, True, None, read)  # kernels loaded before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe(x, logits, t["gate_up"], t["down"], 8, True, None, read)
    other = moe_case(*case, seed=5, device="cuda")
    x.copy_(other["x"])
    logits.copy_(other["logits"])
    read.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = ops.moe(other["x"], other["logits"], t["gate_up"], t["down"], 8, True, None, None)
    assert torch.equal(out, want)
    assert int(read) == len(torch.unique(ref.moe_route(other["logits"], 8, True)[0]))


@pytest.mark.parametrize("clusters", [True, False])
@pytest.mark.parametrize("experts, top_k, hidden, width", [(128, 8, 2048, 0), (60, 4, 1000, 0), (512, 10, 4096, 0),
                                                            (6, 2, 8, 0), (512, 10, 2048, 32), (60, 4, 2048, 120)])
def test_batch_one_router_equals_norm_gemv_and_route(ops, monkeypatch, experts, top_k, hidden, width, clusters):
    """moe_router_bf16 through ``CudaOps.moe_norm_route`` (one row): x is ``rms_norm``'s bytes, the
    route ``moe_route``'s on the logits ``gemv_norm`` gives with the router as its weight (ids,
    weights and plan; with a shared expert of ``width`` the router's last row is its gate, and the
    experts are 32 wide, so one chunk or four, the last one short), ``experts_read`` counts its
    routed experts, and ``moe_routed`` on it equals ``moe`` on those logits; the same again from a
    CUDA graph replayed on new inputs. With clusters, a grid of 2 to 16 CTAs (128 experts: 16; 60:
    8) routes in CTA 0 from the logits the cluster gathers; without, the last CTA once it has
    loaded every logit, leaving the words pending (0xffff) for the next launch."""
    if not clusters:
        monkeypatch.setattr(cuda_moe, "MOE_ROUTER_CLUSTER", 1)
    g = torch.Generator(device="cuda").manual_seed(experts)
    rand = lambda *shape, scale: (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)
    sh = SharedExpert(rand(2 * width, hidden, scale=hidden ** -0.5), rand(hidden, width, scale=0.2)) if width else None
    slots = sh.chunks(32) if sh else 0
    total = experts + slots
    h = rand(1, hidden, scale=3)
    gamma = (1 + torch.randn(hidden, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    router = rand(experts + (slots > 0), hidden, scale=hidden ** -0.5)
    gate_up = rand(experts, 64, hidden, scale=hidden ** -0.5)
    down = rand(experts, hidden, 32, scale=0.2)
    read = torch.zeros(1, dtype=torch.long, device="cuda")

    def check(x, route, out):
        want_x = ops.rms_norm(h, gamma, 1e-6)
        logits = ops.gemv_norm(h, None, gamma, 1e-6, router)[0]
        ids, weights, plan = ops._route(logits, top_k, True, None, slots)
        assert torch.equal(x, want_x)
        assert torch.equal(route.ids, ids) and torch.equal(route.weights, weights)
        n = int(plan[0])  # the plan's defined entries: n experts, n + 1 offsets, every pair
        for part in (slice(0, 1 + n), slice(1 + total, 2 + total + n), slice(2 + 2 * total, None)):
            assert torch.equal(route.plan[part], plan[part])
        assert int(read) == len(torch.unique(ids[:, :top_k]))
        assert torch.equal(out, ops.moe(want_x, logits, gate_up, down, top_k, True, h, None, sh))

    def step():
        x, route = ops.moe_norm_route(h, gamma, 1e-6, router, top_k, True, read, slots)
        return x, route, ops.moe_routed(x, route, gate_up, down, h, sh)

    check(*step())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    h.copy_(torch.randn(1, hidden, device="cuda", generator=g) * 3)
    read.zero_()
    graph.replay()
    torch.cuda.synchronize()
    check(*captured)
    assert bool((ops._pending_logits(h.device, 1).view(torch.int16) == -1).all())
