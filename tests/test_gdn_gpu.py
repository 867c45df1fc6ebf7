"""The cuda backend's Gated DeltaNet decode (kernels/cuda_gdn.py, gdn.cu) against ``gdn_reference.decode``, on an H200.

The cases of ``tests/gdn_cases.py`` (odd shapes, padding rows in the scratch slot, wrapping
windows, several steps carrying state and window) and the real models' shapes: Qwen3-Next's 16
key and 32 value heads of 128 at 1, 16 and 64 rows, Qwen3.5-27B's 48 value heads, K = 4. Outputs
and pools are held to the reference on the GPU with the "gdn" row, 95% of the outputs bit for
bit (FMA and the GPU's own exp / rsqrt move a few across a rounding edge); the launch may not
wait for the GPU, and a CUDA graph of it must replay as the eager launch does, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from gdn_cases import CASES, case_id, check_steps, copy_layer, gdn_layer, live_rows, row_slots, step_inputs
from metrale_cli.kernels import cuda_gdn

pytestmark = pytest.mark.gpu

EQUAL_SHARE = 0.95
# (rows, key heads, value heads per key head, Dk, Dv, conv taps)
REAL = [(1, 16, 2, 128, 128, 4), (16, 16, 2, 128, 128, 4), (64, 16, 2, 128, 128, 4), (16, 16, 3, 128, 128, 4)]


@pytest.mark.parametrize("case", CASES + REAL, ids=case_id)
def test_decode_steps_equal_the_reference(ops, case):
    check_steps(ops.gdn_decode, case, EQUAL_SHARE, steps=4, device="cuda")


def test_inputs_of_their_own_equal_views_of_one_projection(ops):
    check_steps(ops.gdn_decode, REAL[1], EQUAL_SHARE, steps=2, fused=False, device="cuda")


def _step(case, layer, device="cuda"):
    rows = case[0]
    slots = row_slots(rows, layer.conv_pool.shape[0] - 1, device)
    positions = torch.arange(rows, dtype=torch.int32, device=device) % 6
    return step_inputs(layer, rows, 1, True, device), slots, positions


def test_decode_never_waits_for_the_gpu(ops):
    case = REAL[1]
    layer = gdn_layer(case, device="cuda")
    inputs, slots, positions = _step(case, layer)
    ops.gdn_decode(*inputs, copy_layer(layer), slots, positions)  # the kernel loaded first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = ops.gdn_decode(*inputs, layer, slots, positions)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = ops.gdn_decode(*inputs, gdn_layer(case, device="cuda"), slots, positions)
    live = live_rows(case[0]).cuda()  # padding rows race on the scratch slot
    assert torch.equal(got[live], want[live])


@pytest.mark.parametrize("case", [REAL[0], (1, 16, 3, 128, 128, 4), CASES[0]], ids=case_id)
def test_the_one_row_entry_equals_the_general_one_bit_for_bit(ops, case, monkeypatch):
    """Batch 1's entry (its pool reads before the PDL wait) against the general one, three steps
    from the same pools: the same output and pools, bit for bit."""
    one = gdn_layer(case, device="cuda")
    general = copy_layer(one)
    slots = row_slots(1, one.conv_pool.shape[0] - 1, "cuda")
    for step in range(3):
        positions = torch.tensor([1 + step], dtype=torch.int32, device="cuda")
        inputs = step_inputs(one, 1, 10 + step, True, "cuda")
        got = ops.gdn_decode(*inputs, one, slots, positions)
        monkeypatch.setattr(cuda_gdn, "GDN_ONE", False)
        want = ops.gdn_decode(*inputs, general, slots, positions)
        monkeypatch.setattr(cuda_gdn, "GDN_ONE", True)
        assert torch.equal(got, want)
        assert torch.equal(one.conv_pool, general.conv_pool) and torch.equal(one.recurrent_pool, general.recurrent_pool)


@pytest.mark.parametrize("case", [REAL[1], REAL[0], CASES[2]], ids=case_id)
def test_a_cuda_graph_replays_as_the_eager_launch(ops, case):
    rows = case[0]
    layer = gdn_layer(case, device="cuda")
    (mixed, z, b, a), slots, positions = _step(case, layer)
    projection = torch.cat([mixed, z, b, a], -1)  # static inputs: one projection's rows, as the layer's
    static = projection.split([t.shape[1] for t in (mixed, z, b, a)], -1)
    ops.gdn_decode(*static, copy_layer(layer), slots, positions)  # loaded before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.gdn_decode(*static, layer, slots, positions)
    eager = copy_layer(layer)  # capture ran nothing: the pools as they were
    live = live_rows(rows).cuda()
    for step in range(3):
        projection.copy_(torch.cat(step_inputs(layer, rows, 10 + step, True, "cuda"), -1))
        graph.replay()
        want = ops.gdn_decode(*static, eager, slots, positions)
        assert torch.equal(out[live], want[live])
        positions.add_(live.int())
    scratch = layer.conv_pool.shape[0] - 1  # padding rows race on the scratch slot
    assert torch.equal(layer.conv_pool[:scratch], eager.conv_pool[:scratch])
    assert torch.equal(layer.recurrent_pool[:scratch], eager.recurrent_pool[:scratch])
