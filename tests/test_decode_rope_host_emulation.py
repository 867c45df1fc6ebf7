"""paged_decode_rope_tc<suffix>, the bf16 / fp8 cache's decode attention in one launch, run on the
CPU (``kernels_cu/host``, emulate.h), against the launches it replaces, run the same way:
rope_and_cache_<dtype>, then paged_decode_attn_tc<suffix> and its split combine. Output and cache bytes are
equal; the output is also within the attention tolerance of the torch reference.
"""

import ctypes
import math

import pytest
import torch

from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.cases import compare, compare_bytes, kv_to, rope_decode_case
from metrale_cli.kernels.tolerances import bounds
from metrale_cli.kernels.table import TC_ROWS
from metrale_cli.kv.dtypes import KvCacheDtype
from host_build import build_host_library, build_tc_decode_library

EPS = 1e-6


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The host libraries: the tensor-core decode as each of its modules builds it (head_dim 64 /
    128, and 256) and rope_and_cache."""
    out = tmp_path_factory.mktemp("rope_decode_host")
    return {"tc": {d: build_tc_decode_library(out, d) for d in (128, 256)},
            "rope": build_host_library("rope_and_cache_host.cpp", out)}


@pytest.fixture
def libs(built, head_dim):
    return built["tc"][max(head_dim, 128)], built["rope"]


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _strides(c):
    """q / k / v are views of one fused row per token: their token stride is its width."""
    width = c["q"].stride(0)
    assert c["k"].stride(0) == c["v"].stride(0) == width
    return [width] * 3


def fused(lib, c, kp, vp, splits, fp8, preload=False, cluster=False):
    batch, hq, d = c["q"].shape
    rot = 2 * c["cos"].shape[1]
    hk = c["k"].shape[1]
    out = torch.full((batch, hq, d), float("nan")).to(torch.bfloat16)
    part_o = torch.full((batch, hq, splits, d), float("nan"))
    part_ml = torch.full((batch, hq, splits, 2), float("nan"))
    chunks = math.ceil(hq // hk / TC_ROWS)
    counters = torch.zeros(batch * hk * chunks, dtype=torch.int32)
    lib.host_paged_decode_rope_tc(
        *(_ptr(t) for t in (c["q"], c["k"], c["v"], kp.data, vp.data, c["slot_mapping"], c["positions"], c["cos"],
                            c["sin"], c["q_norm"], c["k_norm"], c["block_tables"], c["seq_lens"], out, part_o,
                            part_ml, counters, kp.scale, vp.scale)),
        ctypes.c_float(d**-0.5), *_strides(c), hq, hk, d, rot, c["block_tables"].shape[1], splits,
        ctypes.c_float(EPS), batch, chunks, int(fp8), int(preload), int(cluster))
    assert not counters.any()  # every launch leaves its counters zero
    return out


def unfused(tc, rc, c, kp, vp, splits, fp8):
    batch, hq, d = c["q"].shape
    rot = 2 * c["cos"].shape[1]
    hk = c["k"].shape[1]
    q = torch.zeros(batch, hq, d, dtype=torch.bfloat16)
    dtype = list(KvCacheDtype).index(KvCacheDtype.FP8 if fp8 else KvCacheDtype.BF16)  # the library's numbering
    assert rc.host_rope_and_cache(
        dtype, batch, *(_ptr(t) for t in (c["q"], c["k"], c["v"], q, kp.data, vp.data, c["slot_mapping"],
                                          c["positions"], c["cos"], c["sin"], c["q_norm"], c["k_norm"], kp.scale,
                                          vp.scale, None, None, None)),
        *_strides(c), hq, hk, d, rot, ctypes.c_float(EPS), 0) == 0
    out = torch.full((batch, hq, d), float("nan")).to(torch.bfloat16)
    part_o = torch.full((batch, hq, splits, d), float("nan"))
    part_ml = torch.full((batch, hq, splits, 2), float("nan"))
    tc.host_paged_decode_tc(*(_ptr(t) for t in (q, kp.data, vp.data, c["block_tables"], c["seq_lens"], out, part_o,
                                                 part_ml, kp.scale, vp.scale)),
                            ctypes.c_float(d**-0.5), hq, hk, d, c["block_tables"].shape[1], splits, batch,
                            math.ceil(hq // hk / TC_ROWS), b"_fp8" if fp8 else b"", None, None)
    return out


@pytest.mark.parametrize("head_dim, rot_dim", [(64, 32), (64, 16), (128, 64), (128, 32), (128, 96), (256, 64)])
@pytest.mark.parametrize("group", [4, 12])
@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.FP8], ids=lambda d: d.value)
def test_one_launch_equals_the_three_at_partial_rotary(libs, dtype, head_dim, rot_dim, group):
    """RoPE on the first rot_dim dims only: pairs a power-of-two number of chunks apart (the
    staging's RoPE from registers) and 96 of 128 (its pairs six chunks apart: through shared
    memory)."""
    tc, rc = libs
    hk = 2
    c = rope_decode_case([1, 7, 16, 99, 300, 0], hk * group, hk, head_dim, dtype, seed=head_dim + rot_dim + group)
    c["cos"], c["sin"] = c["cos"][:, :rot_dim // 2].contiguous(), c["sin"][:, :rot_dim // 2].contiguous()
    fp8 = dtype == KvCacheDtype.FP8
    mine, theirs = kv_to(c["kv"], "cpu"), kv_to(c["kv"], "cpu")
    got = fused(tc, c, mine.k, mine.v, 3, fp8)
    want = unfused(tc, rc, c, theirs.k, theirs.v, 3, fp8)
    assert torch.equal(got, want), compare(got, want, 0, 0)
    assert compare_bytes(mine.k.data, theirs.k.data) is None
    assert compare_bytes(mine.v.data, theirs.v.data) is None


@pytest.mark.parametrize("splits", [1, 3, 32])
@pytest.mark.parametrize("group", [1, 4, 12])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.FP8], ids=lambda d: d.value)
def test_one_launch_equals_the_three(libs, dtype, head_dim, group, splits):
    """A context of one key, a partial and a whole last tile, contexts over several splits, a
    sequence whose slot is skipped (-1: its cache keeps the old key) and an empty one; a group of
    12 takes two CTAs per KV head, which both write the new key. At head_dim 256 a tile is two
    warps' (their scores added through shared memory)."""
    check_one_launch(*libs, dtype, head_dim, group, splits)


@pytest.mark.parametrize("splits", [1, 3, 32])
@pytest.mark.parametrize("group", [1, 4, 12])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.FP8], ids=lambda d: d.value)
def test_preloading_entry_equals_the_three(libs, dtype, head_dim, group, splits):
    """paged_decode_rope_tc_preload<suffix> on the same cases: a warp's first tile read before the
    new key is written (the case's cache holds another key at its slot), that key patched in where
    a tile holds it, the skipped slot's old key kept (at 256 it loads as the default entry)."""
    check_one_launch(*libs, dtype, head_dim, group, splits, preload=True)


@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("splits", [3, 16])
@pytest.mark.parametrize("group", [1, 4, 12])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.FP8], ids=lambda d: d.value)
def test_cluster_combine_equals_the_three(libs, dtype, head_dim, group, splits, preload):
    """The splits of a (KV head, sequence, chunk) as one cluster (the launch at batch 1 where
    rope_decode_cluster allows it): every split, an idle one too, combines its share of the rows
    from the others' partials in their shared memory, with the counter path's arithmetic: the same
    bytes as the three launches. 16 splits leave the short contexts' later splits idle; a group of 12
    is two chunks, each its own cluster."""
    check_one_launch(*libs, dtype, head_dim, group, splits, preload=preload, cluster=True)


def check_one_launch(tc, rc, dtype, head_dim, group, splits, preload=False, cluster=False):
    hk = 2
    c = rope_decode_case([1, 7, 16, 99, 300, 0], hk * group, hk, head_dim, dtype, seed=head_dim + group)
    fp8 = dtype == KvCacheDtype.FP8
    c["slot_mapping"][2] = -1
    mine, theirs = kv_to(c["kv"], "cpu"), kv_to(c["kv"], "cpu")
    got = fused(tc, c, mine.k, mine.v, splits, fp8, preload, cluster)
    want = unfused(tc, rc, c, theirs.k, theirs.v, splits, fp8)
    assert torch.equal(got, want), compare(got, want, 0, 0)
    assert compare_bytes(mine.k.data, theirs.k.data) is None
    assert compare_bytes(mine.v.data, theirs.v.data) is None
    assert torch.equal(got[5], torch.zeros_like(got[5]))
    expect = ref.rope_cache_decode(c["q"], c["k"], c["v"], kv_to(c["kv"], "cpu"), c["slot_mapping"], c["positions"],
                                   c["cos"], c["sin"], c["q_norm"], c["k_norm"], EPS, c["block_tables"],
                                   c["seq_lens"], head_dim**-0.5)
    assert compare(got, expect, *bounds("attention")) is None, compare(got, expect, *bounds("attention"))
