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
