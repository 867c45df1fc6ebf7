"""paged_decode_rope_tc<suffix>, the bf16 / fp8 cache's decode attention in one launch, on the GPU:
output and cache bytes equal to the launches it replaces (rope_and_cache_<dtype>, the tensor-core
decode and its combine, with the same split count), the output within the attention tolerance of
the torch reference on the CPU, and CUDA-graph replays that leave the combine's counters zero."""

from __future__ import annotations

import math

import pytest
import torch

from metrale_cli.kernels import cuda_attention, reference as ref
from metrale_cli.kernels.cuda_attention import decode_splits, rope_decode_cluster
from metrale_cli.kernels.cases import compare, compare_bytes, kv_to, rope_decode_args, rope_decode_case
from metrale_cli.kernels.table import TC_LONG_KEYS_PER_SPLIT, TC_MIN_KEYS_PER_SPLIT, TC_ROWS
from metrale_cli.kernels.tolerances import bounds

pytestmark = pytest.mark.gpu
ATTENTION_TOL = bounds("attention")


def _attention(ops, c):
    return ops.paged_attention(c["kv"].dtype, c["kv"].head_dim)


def _both(ops, c):
    attention = _attention(ops, c)
    mine, theirs = kv_to(c["kv"], "cuda"), kv_to(c["kv"], "cuda")
    got = attention.rope_cache_decode(*rope_decode_args(c, mine, "cuda"))
    args = rope_decode_args(c, theirs, "cuda")
    want = attention.paged_decode(attention.rope_and_cache(*args[:11]), *args[3:4], *args[11:])
    return got, want, mine, theirs


@pytest.mark.parametrize("lens", [[1], [577], [4099], [16400], [1, 16, 17, 600, 0, 33], [1024] * 64])
@pytest.mark.parametrize("hq, hk", [(8, 8), (16, 8), (32, 8), (32, 2), (12, 2)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_one_launch_equals_the_three(ops, dtype, lens, hq, hk, head_dim):
    """Batch 1 at the benches' contexts (10 to 16 splits, in a cluster where the grid allows; 60 or
    64 at 16k, 61 of them live), ragged batches with an empty sequence, 64 sequences of 1k (one
    split each); groups of 1 to 16 (two CTAs per KV head)."""
    c = rope_decode_case(lens, hq, hk, head_dim, dtype, seed=len(lens) + hq + head_dim)
    got, want, mine, theirs = _both(ops, c)
    assert torch.equal(got, want), compare(got, want, 0, 0)
    assert compare_bytes(mine.k.data, theirs.k.data) is None
    assert compare_bytes(mine.v.data, theirs.v.data) is None
    if sum(lens) <= 5000:
        expect = ref.rope_cache_decode(*rope_decode_args(c, kv_to(c["kv"], "cpu"), "cpu"))
        assert compare(got, expect, *ATTENTION_TOL) is None, compare(got, expect, *ATTENTION_TOL)


@pytest.mark.parametrize("lens, hq, hk", [([577], 32, 4), ([1000], 16, 2), ([600, 300, 0, 33], 16, 2), ([200], 8, 8)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_cluster_combines_as_the_counter_does(ops, monkeypatch, dtype, lens, hq, hk, head_dim):
    """Few splits on a small grid combine in a cluster: 10 and 16 splits (non-portable sizes), idle
    splits and an empty sequence in a batch, 4 splits. Output and cache bytes equal the counter
    combine's (clusters turned off) and the three launches'."""
    c = rope_decode_case(lens, hq, hk, head_dim, dtype, seed=len(lens) + hq + head_dim)
    attention = _attention(ops, c)
    items = hk * len(lens) * math.ceil(hq // hk / TC_ROWS)
    splits = decode_splits(torch.device("cuda"), items, c["block_tables"].shape[1], attention.tc.ctas_per_sm,
                           TC_MIN_KEYS_PER_SPLIT, attention.tc.max_splits, TC_LONG_KEYS_PER_SPLIT)
    assert rope_decode_cluster(torch.device("cuda"), items, splits) == splits > 1
    got, want, mine, theirs = _both(ops, c)
    monkeypatch.setattr(cuda_attention, "TC_MAX_CLUSTER", 1)
    assert rope_decode_cluster(torch.device("cuda"), items, splits) == 1
    counter, _, by_counter, _ = _both(ops, c)
    assert torch.equal(got, counter), compare(got, counter, 0, 0)
    assert torch.equal(got, want), compare(got, want, 0, 0)
    for a, b in ((mine, theirs), (mine, by_counter)):
        assert compare_bytes(a.k.data, b.k.data) is None
        assert compare_bytes(a.v.data, b.v.data) is None


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_graph_replays_keep_the_counters_zero(ops, dtype):
    """Ten replays of a captured launch, the context growing by one key each time: every replay's
    output equals the unfused launches' on the same inputs (the table holds blocks for all of them:
    the new key's block is the sequence's own, as the block allocator guarantees)."""
    c = rope_decode_case([310], 32, 8, 128, dtype, seed=3)
    attention, kv = _attention(ops, c), kv_to(c["kv"], "cuda")
    args = list(rope_decode_args(c, kv, "cuda"))
    attention.rope_cache_decode(*args)  # the counters exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.rope_cache_decode(*args)
    table = c["block_tables"][0]
    for step in range(10):
        n = 301 + step
        args[12].fill_(n)  # seq_lens
        args[5].fill_(n - 1)  # positions
        args[4].fill_(int(table[(n - 1) // 16]) * 16 + (n - 1) % 16)  # slot_mapping
        args[0].copy_(torch.randn_like(args[0]))
        graph.replay()
        theirs = kv_to(kv, "cuda")
        want = attention.paged_decode(attention.rope_and_cache(*args[:3], theirs, *args[4:11]), theirs, *args[11:])
        torch.cuda.synchronize()
        assert torch.equal(out, want), (step, compare(out, want, 0, 0))
    assert not ops._counters[torch.cuda.current_device()].any()


@pytest.mark.parametrize("lens, hq, hk", [([1], 16, 8), ([577], 16, 8), ([4099], 8, 8), ([577], 32, 4),
                                          ([1, 16, 17, 600, 0, 33], 16, 2), ([1024] * 64, 32, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_preloading_entry_gives_the_default_entrys_bytes(ops, dtype, lens, hq, hk, head_dim):
    """paged_decode_rope_tc_preload<suffix> (each warp's first tile loaded before the PDL wait, the
    new key patched in from shared memory) moves loads only: output and cache bytes equal the
    default entry's and the three launches' (batch 1 with two or one query heads a KV head, which
    the host gives it, and the other shapes, forced)."""
    c = rope_decode_case(lens, hq, hk, head_dim, dtype, seed=len(lens) + hq + head_dim + 7)
    attention = _attention(ops, c)
    runs = []
    for preload in (True, False):
        kv = kv_to(c["kv"], "cuda")
        runs.append((attention.rope_cache_decode(*rope_decode_args(c, kv, "cuda"), preload=preload), kv))
    (got, mine), (want, theirs) = runs
    assert torch.equal(got, want), compare(got, want, 0, 0)
    assert compare_bytes(mine.k.data, theirs.k.data) is None
    assert compare_bytes(mine.v.data, theirs.v.data) is None
    _, unfused, _, _ = _both(ops, c)
    assert torch.equal(got, unfused), compare(got, unfused, 0, 0)
