"""paged_decode_rope_tc<suffix>, the bf16 / fp8 cache's decode attention in one launch, on the GPU:
output and cache bytes equal to the launches it replaces (rope_and_cache_<dtype>, the tensor-core
decode and its combine, with the same split count), the output within the attention tolerance of
the torch reference on the CPU, and CUDA-graph replays that leave the combine's counters zero."""

from __future__ import annotations

import pytest
import torch

from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.checks import (
    ATTENTION_TOL, compare, compare_bytes, pool_to, rope_decode_args, rope_decode_case,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    from metrale_cli.kernels.cuda_ops import CudaOps

    return CudaOps()


def _both(ops, c):
    mine, theirs = ([pool_to(c["k_pool"], "cuda"), pool_to(c["v_pool"], "cuda")] for _ in range(2))
    got = ops.rope_cache_decode(*rope_decode_args(c, *mine, "cuda"))
    args = rope_decode_args(c, *theirs, "cuda")
    want = ops.paged_decode(ops.rope_and_cache(*args[:12]), *args[3:5], *args[12:])
    return got, want, mine, theirs


@pytest.mark.parametrize("lens", [[1], [577], [4099], [1, 16, 17, 600, 0, 33], [1024] * 64])
@pytest.mark.parametrize("hq, hk", [(8, 8), (16, 8), (32, 8), (32, 2), (12, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_one_launch_equals_the_three(ops, dtype, lens, hq, hk, head_dim):
    """Batch 1 at the benches' contexts (many splits), ragged batches with an empty sequence, 64
    sequences of 1k (one split each); groups of 1 to 16 (two CTAs per KV head)."""
    c = rope_decode_case(lens, hq, hk, head_dim, dtype, seed=len(lens) + hq + head_dim)
    got, want, mine, theirs = _both(ops, c)
    assert torch.equal(got, want), compare(got, want, 0, 0)
    assert compare_bytes(mine[0].data, theirs[0].data) is None
    assert compare_bytes(mine[1].data, theirs[1].data) is None
    if sum(lens) <= 5000:
        cpu = [pool_to(c["k_pool"], "cpu"), pool_to(c["v_pool"], "cpu")]
        expect = ref.rope_cache_decode(*rope_decode_args(c, *cpu, "cpu"))
        assert compare(got, expect, *ATTENTION_TOL) is None, compare(got, expect, *ATTENTION_TOL)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_graph_replays_keep_the_counters_zero(ops, dtype):
    """Ten replays of a captured launch, the context growing by one key each time: every replay's
    output equals the unfused launches' on the same inputs (the table holds blocks for all of them:
    the new key's block is the sequence's own, as the block allocator guarantees)."""
    c = rope_decode_case([310], 32, 8, 128, dtype, seed=3)
    kp, vp = pool_to(c["k_pool"], "cuda"), pool_to(c["v_pool"], "cuda")
    args = list(rope_decode_args(c, kp, vp, "cuda"))
    ops.rope_cache_decode(*args)  # the counters exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.rope_cache_decode(*args)
    table = c["block_tables"][0]
    for step in range(10):
        n = 301 + step
        args[13].fill_(n)  # seq_lens
        args[6].fill_(n - 1)  # positions
        args[5].fill_(int(table[(n - 1) // 16]) * 16 + (n - 1) % 16)  # slot_mapping
        args[0].copy_(torch.randn_like(args[0]))
        graph.replay()
        theirs = [pool_to(kp, "cuda"), pool_to(vp, "cuda")]
        want = ops.paged_decode(ops.rope_and_cache(*args[:3], *theirs, *args[5:12]), *theirs, *args[12:])
        torch.cuda.synchronize()
        assert torch.equal(out, want), (step, compare(out, want, 0, 0))
    assert not ops._counters[torch.cuda.current_device()].any()
