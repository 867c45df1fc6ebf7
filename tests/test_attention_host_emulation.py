"""The paged attention kernels' body, run on the CPU, equals the torch references.

``kernels_cu/host/paged_attention_host.cpp`` compiles paged_decode.cu and prefill_paged.cu for
the host (emulate.h: a block's threads as fibers, warp shuffles and barriers emulated, IEEE fp32)
with the K / V side types of one KV dtype, and launches them over the grids CudaOps uses: the
key batches, the transposed reduction of their dot products, splits and their combine and the
online softmax are checked here on any machine; the GPU tests check the compiled kernels the
same way on an H200. Tolerance: that of tests/test_kernels_gpu.py's "attention" row.
"""

import ctypes
import math

import pytest
import torch

from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.rotation import restore_output
from metrale_cli.kernels.table import TC_ROWS, decode_rows, rows_per_cta
from metrale_cli.kernels.cases import compare, fill_turbo8_v, make_paged_case
from metrale_cli.kernels.registry import tc_module
from metrale_cli.kernels.tolerances import bounds
from metrale_cli.kv.dtypes import KvCacheDtype, SideType, kv_pair
from host_build import build_host_library, build_tc_decode_library

ATOL, RTOL = bounds("attention")
DTYPES = [KvCacheDtype.BF16, KvCacheDtype.FP8, KvCacheDtype.NVFP4, KvCacheDtype.TURBO4, KvCacheDtype.TURBO3,
          KvCacheDtype.TURBO8, KvCacheDtype.FP8K_TURBO2V, KvCacheDtype.BF16K_TURBO3V]
_LIBS: dict[KvCacheDtype, ctypes.CDLL] = {}


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("attention_host")


def library(build_dir, dtype: KvCacheDtype) -> ctypes.CDLL:
    if dtype not in _LIBS:
        k, v = (s.value for s in kv_pair(dtype))
        handle = build_host_library("paged_attention_host.cpp", build_dir, {"K_SIDE": k, "V_SIDE": v},
                                    f"attention_{dtype.value}")
        handle.host_paged_decode.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_float] + [ctypes.c_int] * 7 + [
            ctypes.c_void_p]
        handle.host_paged_prefill.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_float] + [ctypes.c_int] * 6
        _LIBS[dtype] = handle
    return _LIBS[dtype]


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _q(tokens, hq, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hq, head_dim, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("splits", [1, 4, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.value)
def test_decode_equals_the_reference(build_dir, dtype, head_dim, group, splits):
    lib, hk = library(build_dir, dtype), 2
    c = make_paged_case([1, 7, 19, 99, 16, 0], hk * group, hk, head_dim, dtype, seed=head_dim + group)
    q = _q(6, hk * group, head_dim, seed=3)
    out = torch.full_like(q, float("nan"))
    part_o = torch.full((6, hk * group, splits, head_dim), float("nan"))
    part_ml = torch.full((6, hk * group, splits, 2), float("nan"))
    chunks = math.ceil(group / decode_rows(head_dim, group))
    kp, vp, tables, lens = c["kv"].k, c["kv"].v, c["block_tables"], c["seq_lens"]
    lib.host_paged_decode(_ptr(q), _ptr(kp.data), _ptr(vp.data), _ptr(tables), _ptr(lens), _ptr(out), _ptr(part_o),
                          _ptr(part_ml), _ptr(kp.scale), _ptr(vp.scale), head_dim**-0.5, hk * group, hk, head_dim,
                          tables.shape[1], splits, 6, chunks, None)
    want = ref.paged_decode(q, c["kv"], tables, lens, head_dim**-0.5)
    assert compare(out, want, ATOL, RTOL) is None, compare(out, want, ATOL, RTOL)
    assert torch.equal(out[5], torch.zeros_like(out[5]))  # an empty context decodes to zero


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if kv_pair(d)[1].is_turbo], ids=lambda d: d.value)
def test_combine_rotates_the_output_back_as_the_wht_launch(build_dir, dtype, head_dim):
    """paged_decode_combine with a rotated V side's signs stores Rᵀ of the row it would store, as
    wht_bf16_inplace_inv after it does (the reference's wht, whose bytes the WHT kernel's equal)."""
    lib, hk, group, splits = library(build_dir, dtype), 2, 4, 4
    c = make_paged_case([1, 7, 99, 0], hk * group, hk, head_dim, dtype, seed=head_dim)
    q = _q(4, hk * group, head_dim, seed=6)
    kp, vp, tables, lens = c["kv"].k, c["kv"].v, c["block_tables"], c["seq_lens"]
    chunks = math.ceil(group / decode_rows(head_dim, group))
    outs = []
    for signs in (None, vp.signs):
        out = torch.full_like(q, float("nan"))
        part_o = torch.full((4, hk * group, splits, head_dim), float("nan"))
        part_ml = torch.full((4, hk * group, splits, 2), float("nan"))
        lib.host_paged_decode(_ptr(q), _ptr(kp.data), _ptr(vp.data), _ptr(tables), _ptr(lens), _ptr(out),
                              _ptr(part_o), _ptr(part_ml), _ptr(kp.scale), _ptr(vp.scale), head_dim**-0.5, hk * group,
                              hk, head_dim, tables.shape[1], splits, 4, chunks, _ptr(signs))
        outs.append(out)
    assert torch.equal(outs[1], restore_output(ref.TorchOps, outs[0].clone(), vp))  # (the WHT is in place)
    assert not torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("tokens, start", [(1, 0), (7, 0), (19, 80), (70, 37)])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.value)
def test_prefill_equals_the_reference(build_dir, dtype, head_dim, group, tokens, start):
    lib, hk = library(build_dir, dtype), 2
    c = make_paged_case([start + tokens], hk * group, hk, head_dim, dtype, seed=tokens)
    q = _q(tokens, hk * group, head_dim, seed=4)
    out = torch.full_like(q, float("nan"))
    kp, vp, table = c["kv"].k, c["kv"].v, c["block_tables"][0].contiguous()
    rows = math.ceil(tokens * group / rows_per_cta(head_dim))
    lib.host_paged_prefill(_ptr(q), _ptr(kp.data), _ptr(vp.data), _ptr(table), _ptr(out), _ptr(kp.scale),
                           _ptr(vp.scale), head_dim**-0.5, tokens, start, hk * group, hk, head_dim, rows)
    want = ref.paged_prefill(q, c["kv"], table, start, head_dim**-0.5)
    assert compare(out, want, ATOL, RTOL) is None, compare(out, want, ATOL, RTOL)


_TC_LIB: dict[tuple, ctypes.CDLL] = {}


def tc_library(build_dir, head_dim: int = 128, **extra: str) -> ctypes.CDLL:
    """paged_decode_tc.cu as the module of ``head_dim`` builds it: head_dim 64 / 128, or 256
    (paged_decode_tc_wide); with ``extra`` defines."""
    key = (tc_module(head_dim), tuple(sorted(extra.items())))
    if key not in _TC_LIB:
        handle = build_tc_decode_library(build_dir, head_dim, extra)
        handle.host_paged_decode_tc.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_float] + [ctypes.c_int] * 7 + [
            ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p]
        _TC_LIB[key] = handle
    return _TC_LIB[key]


def _tc_run(lib, c, q, dtype, splits, in_launch=False, v_signs=None, entry=""):
    """The tensor-core decode of case ``c`` on the emulated CPU: its splits combined by
    paged_decode_combine<suffix>, or (``in_launch``) by the decode launch itself; ``entry``
    "_pair": the dtype's batch-1 pair entry."""
    batch, hq, head_dim = q.shape
    hk = c["kv"].k.num_kv_heads
    chunks = math.ceil(hq // hk / TC_ROWS)
    out = torch.full_like(q, float("nan"))
    part_o = torch.full((batch, hq, splits, head_dim), float("nan"))
    part_ml = torch.full((batch, hq, splits, 2), float("nan"))
    counters = torch.zeros(batch * hk * chunks, dtype=torch.int32) if in_launch else None
    kp, vp, tables, seq = c["kv"].k, c["kv"].v, c["block_tables"], c["seq_lens"]
    lib.host_paged_decode_tc(_ptr(q), _ptr(kp.data), _ptr(vp.data), _ptr(tables), _ptr(seq), _ptr(out),
                             _ptr(part_o), _ptr(part_ml), _ptr(kp.scale), _ptr(vp.scale), head_dim**-0.5, hq, hk,
                             head_dim, tables.shape[1], splits, batch, chunks, (entry + dtype.suffix).encode(),
                             _ptr(counters),
                             _ptr(v_signs))
    if counters is not None:
        assert not counters.any()  # left zero for the next launch
    return out


def _tc_decode(lib, dtype, head_dim, group, splits, lens, seed, in_launch=False):
    """(got, want): the tensor-core decode of ``dtype`` on the emulated CPU and the reference, for a
    case of ``lens`` contexts over 2 KV heads; q's row 1, head 0 is large (the fp8 path's f16 scaling)."""
    hk = 2
    c = make_paged_case(lens, hk * group, hk, head_dim, dtype, seed=seed)
    q = _q(len(lens), hk * group, head_dim, seed=5)
    q[1, 0] *= 3e5  # beyond f16's range: scaled into it by a power of two
    out = _tc_run(lib, c, q, dtype, splits, in_launch)
    return out, ref.paged_decode(q, c["kv"], c["block_tables"], c["seq_lens"], head_dim**-0.5)


@pytest.mark.parametrize("splits", [1, 3, 32])
@pytest.mark.parametrize("group", [1, 4, 8, 12, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.FP8], ids=lambda d: d.value)
def test_tensor_core_decode_equals_the_reference(build_dir, dtype, head_dim, group, splits):
    """paged_decode_tc.cu: whole 16-key tiles, a partial last tile, several tiles per warp, idle
    warps and splits, groups over two CTAs, an empty context; q with a large row (the fp8 path's
    f16 scaling); at head_dim 256 two warps a tile."""
    out, want = _tc_decode(tc_library(build_dir, head_dim), dtype, head_dim, group, splits, [1, 7, 16, 99, 300, 0],
                           head_dim + group)
    assert compare(out, want, ATOL, RTOL) is None, compare(out, want, ATOL, RTOL)
    assert torch.equal(out[5], torch.zeros_like(out[5]))


PACKED = [d for d in KvCacheDtype if d not in (KvCacheDtype.BF16, KvCacheDtype.FP8)]


@pytest.mark.parametrize("splits, group", [(3, 4), (32, 12), (5, 16)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.FP8, KvCacheDtype.TURBO4, KvCacheDtype.NVFP4,
                                   KvCacheDtype.BF16K_TURBO3V, KvCacheDtype.TURBO4K_TURBO3V], ids=lambda d: d.value)
def test_tensor_core_decode_combines_its_splits_as_the_combine_launch(build_dir, dtype, head_dim, group, splits):
    """With counters the decode launch's last split of each (sequence, KV head, chunk) reduces the
    partials: the bytes of paged_decode_combine<suffix> after it, an empty context's zeros
    included; with a rotated V side's signs also those of the WHT launch after that."""
    lib, hk = tc_library(build_dir, head_dim), 2
    c = make_paged_case([1, 7, 16, 99, 300, 0], hk * group, hk, head_dim, dtype, seed=head_dim + splits)
    q = _q(6, hk * group, head_dim, seed=7)
    two = _tc_run(lib, c, q, dtype, splits)
    assert torch.equal(_tc_run(lib, c, q, dtype, splits, in_launch=True), two)
    if kv_pair(dtype)[1].is_turbo:
        vp = c["kv"].v
        rotated = _tc_run(lib, c, q, dtype, splits, in_launch=True, v_signs=vp.signs)
        assert torch.equal(rotated, restore_output(ref.TorchOps, two.clone(), vp))  # (the WHT is in place)
        assert not torch.equal(rotated, two)


@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.NVFP4, KvCacheDtype.TURBO4,
                                   KvCacheDtype.TURBO4K_TURBO3V, KvCacheDtype.BF16K_TURBO4V], ids=lambda d: d.value)
def test_tensor_core_decode_combines_up_to_64_splits(build_dir, dtype):
    """TC_MAX_SPLITS: 4099 keys in 64 splits (52 of them live, two a lane in the combine's
    weights) and 2100 in 64 (44 live), beside a one-key and an empty context: within the attention
    tolerance of the reference, a rotated V side rotated back in the launch."""
    lib, hk, group, head_dim = tc_library(build_dir), 2, 4, 128
    c = make_paged_case([4099, 1, 2100, 0], hk * group, hk, head_dim, dtype, seed=64)
    q = _q(4, hk * group, head_dim, seed=8)
    vp = c["kv"].v
    out = _tc_run(lib, c, q, dtype, 64, in_launch=True, v_signs=vp.signs if vp.rotated else None)
    want = ref.paged_decode(q, c["kv"], c["block_tables"], c["seq_lens"], head_dim**-0.5)
    if vp.rotated:
        want = restore_output(ref.TorchOps, want, vp)
    assert compare(out, want, ATOL, RTOL) is None, compare(out, want, ATOL, RTOL)


TURBO8_V = [d for d in KvCacheDtype if kv_pair(d)[1] == SideType.TURBO8]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", TURBO8_V, ids=lambda d: d.value)
def test_turbo8_v_in_one_bf16_multiply_equals_the_fp32_way(build_dir, dtype, head_dim):
    """A turbo8 V side decoded as e4m3 bits read as bf16 times scale x 2^120 in one bf16x2
    multiply gives the bytes of the fp32 way (tc_pair), which a build with
    TC_TURBO8_FACTOR_MAX=0 takes for every tile: every e4m3 code but NaN (subnormals too), scales
    from 2^-117 to 255 and zero, and three vectors with a scale of 256 or more, whose tiles both
    builds take the fp32 way."""
    hk, group = 2, 4
    c = make_paged_case([1, 7, 16, 99, 300], hk * group, hk, head_dim, dtype, seed=head_dim)
    fill_turbo8_v(c, seed=head_dim, wide=3)
    q = _q(5, hk * group, head_dim, seed=5)
    fast = _tc_run(tc_library(build_dir, head_dim), c, q, dtype, 3)
    assert torch.isfinite(fast).all()
    assert torch.equal(fast, _tc_run(tc_library(build_dir, head_dim, TC_TURBO8_FACTOR_MAX="0"), c, q, dtype, 3))


PAIRED = [d for d in KvCacheDtype if d.row.tensor_core.pair]


@pytest.mark.parametrize("splits, group", [(1, 1), (3, 4), (32, 12), (5, 16)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", PAIRED, ids=lambda d: d.value)
def test_the_pair_entry_equals_the_dtype_entry(build_dir, dtype, head_dim, group, splits):
    """paged_decode_attn_tc_pair<suffix> (two tiles a pass, a tile past the end loaded as zeros,
    a dead key's V zeroed as loaded) gives the dtype entry's bytes: contexts whose warps take an
    odd and an even number of tiles, a partial last tile, a split shorter than a pass, an empty
    context; its splits combined by the combine launch and in the launch, rotated back there
    when its V side is rotated; and within the attention tolerance of the reference."""
    lib, hk = tc_library(build_dir, head_dim), 2
    c = make_paged_case([1, 7, 16, 17, 99, 300, 0, 1000], hk * group, hk, head_dim, dtype, seed=head_dim + splits)
    q = _q(8, hk * group, head_dim, seed=9)
    plain = _tc_run(lib, c, q, dtype, splits)
    pair = _tc_run(lib, c, q, dtype, splits, entry="_pair")
    assert torch.equal(pair, plain)
    assert torch.equal(_tc_run(lib, c, q, dtype, splits, in_launch=True, entry="_pair"), plain)
    vp = c["kv"].v
    if vp.rotated and splits > 1:
        assert torch.equal(_tc_run(lib, c, q, dtype, splits, in_launch=True, v_signs=vp.signs, entry="_pair"),
                           _tc_run(lib, c, q, dtype, splits, in_launch=True, v_signs=vp.signs))
    want = ref.paged_decode(q, c["kv"], c["block_tables"], c["seq_lens"], head_dim**-0.5)
    assert compare(pair, want, ATOL, RTOL) is None, compare(pair, want, ATOL, RTOL)


@pytest.mark.parametrize("splits, group", [(1, 1), (3, 4), (32, 12)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", PACKED, ids=lambda d: d.value)
def test_tensor_core_decode_of_packed_sides_equals_the_reference(build_dir, dtype, head_dim, group, splits):
    """The packed sides' dequantization in the tensor-core decode (codes read as slices: 3-byte
    turbo3 words cut mid-byte, group scales, the levels table, turbo8's bf16 scales, dead keys'
    zeroed codes and scales), for every dtype with a packed side, beside an fp8 or bf16 K side;
    at head_dim 256 each warp of a tile's two takes half of every vector."""
    out, want = _tc_decode(tc_library(build_dir, head_dim), dtype, head_dim, group, splits, [1, 7, 16, 99, 0],
                           head_dim + 3)
    assert compare(out, want, ATOL, RTOL) is None, compare(out, want, ATOL, RTOL)
    assert torch.equal(out[4], torch.zeros_like(out[4]))


SCALE_WORD_V = [d for d in PACKED if kv_pair(d)[1] not in (SideType.BF16, SideType.FP8, SideType.TURBO8)]


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", SCALE_WORD_V, ids=lambda d: d.value)
def test_v_scales_from_a_word_a_lane_give_the_byte_loads_bytes(build_dir, dtype, head_dim):
    """A packed V side's group scales loaded as one word a lane and handed to their keys' lanes
    by shuffles (TC_V_SCALE_WORD=2: every entry it serves) give the bytes of the build that loads
    each key's scale byte on its own (=0): partial last tiles (dead keys' scales zeroed), several
    tiles a warp, splits combined in the launch, an empty context; at head_dim 256 the two parts'
    groups of each key."""
    hk, group = 2, 4
    c = make_paged_case([1, 7, 16, 17, 99, 300, 0], hk * group, hk, head_dim, dtype, seed=head_dim + 11)
    q = _q(7, hk * group, head_dim, seed=13)
    word = _tc_run(tc_library(build_dir, head_dim, TC_V_SCALE_WORD="2"), c, q, dtype, 3, in_launch=True)
    assert torch.isfinite(word[:6]).all() and torch.equal(word[6], torch.zeros_like(word[6]))
    assert torch.equal(word, _tc_run(tc_library(build_dir, head_dim, TC_V_SCALE_WORD="0"), c, q, dtype, 3,
                                     in_launch=True))
