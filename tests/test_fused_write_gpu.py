"""The fused QK-norm + RoPE + cache write kernels on the GPU (an H200 or another sm_90 GPU).

``CudaOps.rope_and_cache`` must give exactly the q and the cache bytes of the unfused CUDA
sequence it replaces (rms_norm, rms_norm, rope, reshape_and_cache), for every dtype and head_dim
the build serves, and match the torch reference (run on the CPU: it defines the bytes):

- q: exact without QK-norm (RoPE rounds as the reference), within "norm" with it;
- V bytes: exact (no norm, no RoPE on V);
- K bytes: exact wherever the K the write receives is the same bf16 as the reference's; the
  norm's <= 1-ulp differences may change the others (test_fused_write.py's helper says how).
"""

import pytest
import torch

from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.cases import compare, compare_bytes, kv_to
from metrale_cli.kernels.kv_kernels import served_head_dims
from metrale_cli.kernels.rotation import rotate_query
from metrale_cli.kv.dtypes import KvCacheDtype, SideType
from test_fused_write import (
    EPS,
    NORM_TOL,
    assert_k_matches_reference_where_inputs_agree,
    assert_same_bytes,
    clone_kv,
    fused,
    make_case,
    unfused,
)

pytestmark = pytest.mark.gpu

CASES = [(dtype, d) for dtype in KvCacheDtype for d in served_head_dims(dtype)]
VARIANTS = [("qk-norm", 2), ("qk-norm", 1), ("none", 2)]  # (QK-norm, head_dim / rot_dim)


def to_gpu(c):
    """The case on the GPU: q / k / v stay views of one qkv tensor."""
    g = {key: t.cuda() if isinstance(t, torch.Tensor) else t for key, t in c.items() if key not in ("q", "k", "v")}
    tokens, hq, d = c["q"].shape
    hk = c["k"].shape[1]
    q, k, v = g["qkv"].split([hq * d, hk * d, hk * d], dim=-1)
    g.update(q=q.view(tokens, hq, d), k=k.view(tokens, hk, d), v=v.view(tokens, hk, d))
    return g


@pytest.mark.parametrize("norm, rot_div", VARIANTS, ids=lambda x: str(x))
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("tokens", [1, 7, 99])
@pytest.mark.parametrize("dtype, head_dim", CASES, ids=lambda x: getattr(x, "value", str(x)))
def test_fused_equals_the_unfused_kernels_and_the_reference(ops, dtype, head_dim, tokens, group, norm, rot_div):
    c = make_case(dtype, head_dim, hq=2 * group, hk=2, tokens=tokens, rot_dim=head_dim // rot_div,
                  seed=tokens + head_dim)
    c["k"][0, 0, :3] = c["v"][0, 0, :3] = torch.tensor([1e4, -1e4, 0.0])  # saturates fp8 and group scales
    c["k"][-1, 1, 16:32] = 0.0  # an all-zero group
    q_norm, k_norm = (c["q_norm"], c["k_norm"]) if norm == "qk-norm" else (None, None)
    g = to_gpu(c)
    gq_norm, gk_norm = (g["q_norm"], g["k_norm"]) if q_norm is not None else (None, None)
    mine, theirs = clone_kv(c, "cuda"), clone_kv(c, "cuda")

    got = fused(ops, g, mine, gq_norm, gk_norm)
    want, k_kernel = unfused(ops, g, theirs, gq_norm, gk_norm)
    assert got.is_contiguous() and torch.equal(got, want)
    written = c["slots"][c["slots"] >= 0]
    assert_same_bytes(mine.k, theirs.k, written)
    assert_same_bytes(mine.v, theirs.v, written)
    assert torch.equal(g["qkv"].cpu(), c["qkv"])  # inputs untouched

    ref_kv = clone_kv(c)
    q_ref = ref.rope_and_cache(c["q"], c["k"], c["v"], ref_kv, c["slots"], c["positions"], c["cos"], c["sin"],
                               q_norm, k_norm, EPS)
    assert compare_bytes(mine.v.data, ref_kv.v.data) is None
    if q_norm is None:
        assert torch.equal(got.cpu(), q_ref)
        assert compare_bytes(mine.k.data, ref_kv.k.data) is None
    else:
        assert compare(got, q_ref, *NORM_TOL) is None
        k_ref = ref.rope(c["q"], ref.rms_norm(c["k"], k_norm, EPS), c["positions"], c["cos"], c["sin"])[1]
        assert_k_matches_reference_where_inputs_agree(mine.k, ref_kv.k, k_kernel.cpu(), k_ref, c["slots"])


@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.FP8, KvCacheDtype.NVFP4, KvCacheDtype.TURBO4,
                                   KvCacheDtype.FP8K_TURBO2V, KvCacheDtype.TURBO3K_TURBO8V])
def test_launch_inside_a_cuda_graph_replays(ops, dtype):
    """A decode step's prologue captured once, then replayed with new inputs in its static
    buffers (qkv row, positions, slots, fp8 scales rewritten in place): each replay equals the
    unfused kernels run eagerly on the same inputs and the same cache."""
    c = make_case(dtype, 128, hq=8, hk=2, tokens=3, rot_dim=64, seed=5)
    g = to_gpu(c)
    kv = clone_kv(c, "cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused(ops, g, kv, g["q_norm"], g["k_norm"])  # warm-up: compiles and loads outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(ops, g, kv, g["q_norm"], g["k_norm"])
    for seed in (10, 11):
        new = make_case(dtype, 128, hq=8, hk=2, tokens=3, rot_dim=64, seed=seed)
        for key in ("qkv", "positions", "slots"):
            g[key].copy_(new[key])
        for pool in (kv.k, kv.v):
            if pool.side == SideType.FP8:
                pool.scale.mul_(1.5)
        before = kv_to(kv, "cuda")
        graph.replay()
        want, _ = unfused(ops, g, before, g["q_norm"], g["k_norm"])
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        written = new["slots"][new["slots"] >= 0]
        assert_same_bytes(kv.k, before.k, written)
        assert_same_bytes(kv.v, before.v, written)


@pytest.mark.parametrize("innerq", [True, False], ids=["innerq", "no innerq"])
@pytest.mark.parametrize("dtype, head_dim", [(d, hd) for d, hd in CASES if d.row.k.is_turbo],
                         ids=lambda x: getattr(x, "value", str(x)))
def test_rotate_q_is_the_wht_launch_after_the_kernel(ops, dtype, head_dim, innerq):
    """rotate_q: the query in the K side's basis, as rope_and_cache then rotate_query (the WHT
    launch, then the InnerQ division) give it, byte for byte; the cache bytes are the same."""
    c = make_case(dtype, head_dim, hq=8, hk=2, tokens=7, seed=head_dim + 3)
    g = to_gpu(c)
    plain_kv, rotating_kv = clone_kv(c, "cuda"), clone_kv(c, "cuda")
    if not innerq:
        plain_kv.k.channel_scale = rotating_kv.k.channel_scale = None
    attention = ops.paged_attention(plain_kv.dtype, head_dim)
    args = (g["slots"], g["positions"], g["cos"], g["sin"], g["q_norm"], g["k_norm"], EPS)
    plain = attention.rope_and_cache(g["q"], g["k"], g["v"], plain_kv, *args)
    rotated = attention.rope_and_cache(g["q"], g["k"], g["v"], rotating_kv, *args, rotate_q=True)
    assert torch.equal(rotated, rotate_query(ops, plain.clone(), plain_kv.k))
    assert not torch.equal(rotated, plain)
    written = c["slots"][c["slots"] >= 0]
    assert_same_bytes(rotating_kv.k, plain_kv.k, written)
    assert_same_bytes(rotating_kv.v, plain_kv.v, written)
