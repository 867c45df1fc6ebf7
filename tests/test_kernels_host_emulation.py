"""The cache-write and cache-read code of every KV side type, run on the CPU, equals the torch codecs.

``kernels_cu/host/kv_codec_host.cpp`` compiles the very warp-level code of
``kernels_cu/include/kv_write.cuh`` and ``kv_formats.cuh`` for the host (32 threads per warp,
IEEE fp32 for the ``__f*_rn`` intrinsics, e4m3 in software): every byte it writes must equal
``kv/formats.store``'s and every value it reads must equal ``kv/formats.load``'s (WHT rotation,
InnerQ scales, saturation, all-zero groups, skipped slots included). The GPU tests check the
compiled kernels the same way on an H200.
"""

import ctypes

import pytest
import torch

from metrale_cli.kv.dtypes import SideType
from metrale_cli.kv.formats import load, new_pool, store
from host_build import build_host_library

SIDES = [SideType.BF16, SideType.FP8, SideType.NVFP4, SideType.TURBO2, SideType.TURBO3, SideType.TURBO4,
         SideType.TURBO8]  # the library's side numbering
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    fn = build_host_library("kv_codec_host.cpp", tmp_path_factory.mktemp("host")).kv_codec_host
    fn.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 4
    return fn


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _inputs(side, head_dim, hk=2, tokens=19, blocks=3):
    g = torch.Generator().manual_seed(head_dim + len(side.value))
    pool = new_pool(side, blocks, hk, head_dim, CPU)
    if side == SideType.FP8:
        pool.scale.fill_(0.02)
    if pool.signs is not None:
        pool.channel_scale = 0.5 + 1.5 * torch.rand(hk, head_dim, generator=g)
    x = (torch.randn(tokens, hk, head_dim, generator=g) * 3).to(torch.bfloat16)
    x[0, 0, :3] = torch.tensor([1e4, -1e4, 0.0])  # saturation
    x[1, 1, 16:32] = 0.0  # an all-zero group
    x[2, 0, :16] = 1e-30  # subnormal after scaling
    slots = torch.randperm(blocks * 16, generator=g)[:tokens].to(torch.int32)
    slots[5] = -1
    return pool, x, slots


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("side", SIDES, ids=lambda s: s.value)
def test_host_write_and_read_equal_the_torch_codecs(codec, side, head_dim):
    pool, x, slots = _inputs(side, head_dim)
    mine = new_pool(side, pool.num_blocks, pool.num_kv_heads, head_dim, CPU)
    rc = codec(SIDES.index(side), head_dim, 1, _ptr(x.contiguous()), _ptr(mine.data), _ptr(slots), x.shape[0],
               pool.num_kv_heads, _ptr(pool.scale), _ptr(pool.signs), _ptr(pool.channel_scale), None)
    assert rc == 0
    store(x, pool, slots)
    got, want = mine.data.view(torch.uint8), pool.data.view(torch.uint8)
    assert int(want.count_nonzero()) > want.numel() // 4  # 18 of the 48 slots hold data
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} bytes differ"

    slots_all = pool.num_blocks * 16
    out = torch.zeros(slots_all, pool.num_kv_heads, head_dim)
    rc = codec(SIDES.index(side), head_dim, 0, None, _ptr(pool.data), None, slots_all, pool.num_kv_heads,
               None, None, None, _ptr(out))
    assert rc == 0
    if side == SideType.FP8:
        out = out * pool.scale  # the kernels fold the per-tensor scale into the scores / output
    expected = load(pool, torch.arange(pool.num_blocks, dtype=torch.int32), slots_all)
    assert torch.equal(out, expected)


def test_software_e4m3_of_gpus_below_sm_89_is_the_conversion_instruction(tmp_path_factory):
    """numeric.cuh's e4m3 in software (what sm_80 compiles in place of cvt.rn.satfinite.e4m3x2.f32
    and cvt.rn.f16x2.e4m3x2): RNE bytes, +-448 past the range, NaN kept; each byte's exact f16.
    Held to torch's float8_e4m3fn (after the saturation it lacks) and to the CPU emulation."""
    lib = build_host_library("kv_codec_host.cpp", tmp_path_factory.mktemp("e4m3"))
    fn = lib.e4m3_software_host
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8)
    levels = codes.view(torch.float8_e4m3fn).float()
    finite = levels[torch.isfinite(levels)].unique()
    mids = (finite[1:] + finite[:-1]) / 2  # every tie between neighbours (RNE picks the even code)
    x = torch.cat([finite, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                   torch.randn(20000, generator=g) * 40, torch.rand(5000, generator=g) * 0.02,
                   torch.tensor([447.9, 448.0, 463.9, 464.0, 480.0, 1e6, float("inf"), float("-inf"), 0.0, -0.0,
                                 2.0 ** -10, 2.0 ** -9 * 1.5, 1e-30, float("nan"), -float("nan")])]).float()
    x = torch.cat([x, -x]).contiguous()
    got, emulated = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(x.numel(), dtype=torch.uint8)
    f16 = torch.empty(256, dtype=torch.int16)
    fn(_ptr(x), _ptr(got), _ptr(emulated), x.numel(), _ptr(codes), _ptr(f16), 256)
    nan = torch.isnan(x)
    want = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got[~nan], want[~nan]) and torch.equal(got[~nan], emulated[~nan])
    assert torch.equal(got[nan] & 0x7f, torch.full_like(got[nan], 0x7f))
    is_nan = (codes & 0x7f) == 0x7f
    want16 = levels.half().view(torch.int16)
    assert torch.equal(f16[~is_nan], want16[~is_nan])
    assert f16[is_nan].tolist() == [0x7fff, -1]  # 0x7f, 0xff: sign | 0x7fff
