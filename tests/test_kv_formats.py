"""The KV side formats: exact bytes of the torch references on hand-computed groups, round trips,
the pool layout of packed blocks, the WHT rotation and the bytes-per-token accounting."""

from __future__ import annotations

import math

import pytest
import torch

from metrale_cli.kv import formats, quant
from metrale_cli.kv.dtypes import KvCacheDtype, SideType
from metrale_cli.kv.paged import KvLayerShape, KvLayout
from metrale_cli.kv.pool import BLOCK_SIZE
from metrale_cli.kv.wht import hadamard_matrix, rotate_fp32, wht_inplace, wht_signs

S = SideType


def _bytes(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).tolist()


# --- exact bytes, hand-computed --------------------------------------------------------------
def test_nvfp4_one_group_exact_bytes():
    # amax 6 -> scale e4m3(1.0) = 0x38; codes = E2M1 index, ties to the even index (0.25 -> 0,
    # 0.75 -> 2 (1.0), 2.5 -> 4 (2.0), 5 -> 6 (4.0), -3.5 -> 8|6), negative adds 8.
    x = torch.tensor([[0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -6, .25, .75, 5, 2.5, -3.5]])
    data, scales = quant.nvfp4_encode(x)
    assert _bytes(data) == [0x10, 0x32, 0x54, 0x76, 0xA9, 0x0F, 0x62, 0xE4]
    assert _bytes(scales) == [0x38]
    decoded = quant.nvfp4_decode(data, scales, 16)
    assert decoded.tolist() == [[0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -6, 0, 1, 4, 2, -4]]


def test_turbo2_one_group_exact_bytes():
    # ss = 34, rms = 1.4577: u = ±1.372 -> codes 3 / 0, u = ±0.343 -> codes 2 / 1;
    # byte = 3 | 0<<2 | 2<<4 | 1<<6 = 0x63. Matched norm: sqrt(34) / sqrt(8·1.5104² + 8·0.4528²)
    # = 1.3074 -> e4m3 1.25 = 0x3A.
    x = torch.tensor([[2.0, -2.0, 0.5, -0.5] * 4])
    data, scales = quant.codebook_encode(x, 2)
    assert _bytes(data) == [0x63] * 4
    assert _bytes(scales) == [0x3A]
    assert torch.allclose(quant.codebook_decode(data, scales, 2, 16),
                          torch.tensor([[1.5104, -1.5104, 0.4528, -0.4528] * 4]) * 1.25)


def test_turbo3_one_group_exact_bytes():
    # rms = 1.59178: u = [1.885, -1.885, .628, -.628, .063, -.063, 0, .314] -> codes
    # [7, 0, 5, 2, 4, 3, 3, 4] (0 is not above the boundary 0: a tie goes to the lower index);
    # w = Σ code_k << 3k = 0x8DC547 -> bytes 47 C5 8D. Scale 6.3671 / 4.6142 = 1.3799 -> 1.375 = 0x3B.
    x = torch.tensor([[3.0, -3.0, 1.0, -1.0, 0.1, -0.1, 0.0, 0.5] * 2])
    data, scales = quant.codebook_encode(x, 3)
    assert _bytes(data) == [0x47, 0xC5, 0x8D] * 2
    assert _bytes(scales) == [0x3B]
    assert quant.unpack(data, 3, 16).tolist() == [[7, 0, 5, 2, 4, 3, 3, 4] * 2]


def test_turbo4_constant_group_exact_bytes():
    # u = 1 for every element -> 11 boundaries below it -> code 11 (level 0.9423), byte 0xBB;
    # scale 4 / (4·0.9423) = 1.0612 -> e4m3 1.0 = 0x38.
    data, scales = quant.codebook_encode(torch.ones(1, 16), 4)
    assert _bytes(data) == [0xBB] * 8 and _bytes(scales) == [0x38]


@pytest.mark.parametrize("bits, code_bytes", [(4, [0x88] * 8), (3, [0x24, 0x49, 0x92] * 2), (2, [0xAA] * 4)])
def test_turbo_zero_group_stores_middle_code_and_zero_scale(bits, code_bytes):
    data, scales = quant.codebook_encode(torch.zeros(1, 16), bits)
    assert _bytes(data) == code_bytes and _bytes(scales) == [0]
    assert quant.codebook_decode(data, scales, bits, 16).abs().sum() == 0


def test_turbo8_exact_bytes():
    # amax 16: scale bf16(16/448) = 0x3D12 (1.140625·2⁻⁵), stored little-endian 12 3D;
    # 1 / s = 28.05 -> e4m3 28 = 0x5E, 16 / s = 448.9 saturates to 448 = 0x7E, -1 -> 0xDE.
    x = torch.zeros(1, 16)
    x[0, :3] = torch.tensor([1.0, 16.0, -1.0])
    data, scales = quant.turbo8_encode(x)
    assert _bytes(data) == [0x5E, 0x7E, 0xDE] + [0] * 13
    assert _bytes(scales) == [0x12, 0x3D]


def test_boundaries_are_fp32_midpoints():
    assert quant.BOUNDARIES[2].tolist() == pytest.approx([-0.9816, 0.0, 0.9816], abs=1e-6)
    assert quant.BOUNDARIES[3][4].item() == pytest.approx(0.50055, abs=1e-6)
    assert quant.BOUNDARIES[4][-1].item() == pytest.approx(2.4008, abs=1e-6)


def test_butterfly_sum_is_the_xor_order():
    v = torch.tensor([1e8, 1.0, -1e8, 1.0] + [0.0] * 12)
    # xor order adds v0 + v8 first, ... ; the final sum keeps the two 1.0s: (1e8 + -1e8) + (1 + 1)
    assert quant.butterfly_sum(v).item() == 2.0


# --- round trips ------------------------------------------------------------------------------
# Per-element NMSE of a round trip on Gaussian data, with the reason for each bound:
ROUND_TRIP_NMSE = {
    S.TURBO8: 2e-3,  # e4m3: 3 mantissa bits, ~1e-3 relative MSE with amax scaling
    S.NVFP4: 2.5e-2,  # e2m1 with an e4m3 amax/6 scale: ~1.1e-2
    S.TURBO4: 1.5e-2,  # 16-level Lloyd-Max of N(0,1): 0.0095 (plus the e4m3 scale rounding)
    S.TURBO3: 4.5e-2,  # 8 levels: 0.0345
    S.TURBO2: 1.5e-1,  # 4 levels: 0.1175
}


@pytest.mark.parametrize("side", list(ROUND_TRIP_NMSE))
def test_codec_round_trip_within_budget(side):
    fmt = formats.side_format(side)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(1))
    data, scales = fmt.encode(x)
    assert data.dtype == torch.uint8 and data.shape == (256, fmt.data_bytes(128))
    assert scales.shape == (256, 128 // 16 * fmt.scale_bytes)
    y = fmt.decode(data, scales, 128)
    nmse = ((y - x).pow(2).sum() / x.pow(2).sum()).item()
    assert nmse <= ROUND_TRIP_NMSE[side], f"{side.value}: {nmse:.4f}"
    assert nmse >= ROUND_TRIP_NMSE[side] / 20  # the budget is not loose by orders of magnitude


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (5, 64), generator=torch.Generator().manual_seed(bits))
    packed = quant.pack(codes, bits)
    assert packed.shape == (5, 64 * bits // 8)
    assert torch.equal(quant.unpack(packed, bits, 64), codes)


# --- pools ------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", [S.NVFP4, S.TURBO3, S.TURBO8])
def test_packed_block_layout(side):
    """Slot 17 = block 1, offset 1: its vectors sit at [head][token] data, then [head][token][group] scales."""
    hk, d = 2, 64
    pool = formats.new_pool(side, 3, hk, d, torch.device("cpu"))
    fmt = formats.side_format(side)
    x = torch.randn(1, hk, d, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    formats.store(x, pool, torch.tensor([17], dtype=torch.int32))
    data, scales = fmt.encode(formats.prepare(x, pool).reshape(hk, d))
    block = pool.data[1]
    db, sb = fmt.data_bytes(d), d // 16 * fmt.scale_bytes
    for h in range(hk):
        at = (h * BLOCK_SIZE + 1) * db
        assert torch.equal(block[at : at + db], data[h])
        at = BLOCK_SIZE * hk * db + (h * BLOCK_SIZE + 1) * sb
        assert torch.equal(block[at : at + sb], scales[h])
    assert pool.data[0].sum() == 0 and pool.data[2].sum() == 0
    back = formats.load(pool, torch.tensor([0, 1], dtype=torch.int32), 18)[17]
    assert torch.allclose(back, fmt.decode(data, scales, d))


def test_negative_slots_are_skipped_and_fp8_uses_the_scale():
    pool = formats.new_pool(S.FP8, 2, 1, 16, torch.device("cpu"))
    pool.scale.fill_(0.5)
    x = torch.full((2, 1, 16), 3.0, dtype=torch.bfloat16)
    formats.store(x, pool, torch.tensor([-1, 5], dtype=torch.int32))
    assert pool.data[0, :, 5].float().tolist() == [[6.0] * 16]  # e4m3(3 / 0.5)
    assert pool.data.float().abs().sum().item() == 6.0 * 16


# --- rotation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_wht_is_the_signed_sylvester_matrix(d):
    signs = wht_signs(d)
    idx = torch.arange(d)
    popcount = torch.zeros(d, d, dtype=torch.long)
    both = idx[:, None] & idx[None, :]
    for bit in range(10):
        popcount += (both >> bit) & 1
    h = (1 - 2 * (popcount % 2)).float()
    expected = torch.diag(signs[1]) @ h @ torch.diag(signs[0]) / math.sqrt(d)
    r = hadamard_matrix(d, signs)
    assert torch.allclose(r, expected, atol=1e-6)
    assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)
    x = torch.randn(3, d)
    assert torch.allclose(rotate_fp32(rotate_fp32(x, signs), signs, inverse=True), x, atol=1e-5)


def test_wht_signs_are_fixed_and_head_dim_checked():
    s = wht_signs(128)
    assert s.shape == (2, 128) and set(s.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(s, wht_signs(128)) and not torch.equal(wht_signs(64), s[:, :64])
    with pytest.raises(Exception, match="head_dim"):
        wht_signs(96)


def test_wht_inplace_rounds_once_to_bf16():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    expected = rotate_fp32(x, wht_signs(64)).to(torch.bfloat16)
    out = wht_inplace(x, wht_signs(64), False)
    assert out is x and torch.equal(x, expected)


# --- memory accounting ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, per_layer", [
    ("bf16", 2 * 3 * 64 * 2), ("fp8", 3 * 64 * 2), ("nvfp4", 3 * (32 + 4) * 2), ("turbo4", 3 * 36 * 2),
    ("turbo3", 3 * (24 + 4) * 2), ("turbo2", 3 * (16 + 4) * 2), ("turbo8", 3 * (64 + 8) * 2),
    ("bf16k_turbo3v", 3 * 128 + 3 * 28), ("fp8k_turbo2v", 3 * 64 + 3 * 20), ("turbo4k_turbo8v", 3 * 36 + 3 * 72),
])
def test_bytes_per_token(dtype, per_layer):
    """Hk = 3, D = 64 (SmolLM2's attention): data + one scale per group of 16, K and V."""
    layout = KvLayout.uniform(30, 3, 64, KvCacheDtype(dtype))
    assert layout.bytes_per_token() == 30 * per_layer
    assert layout.bytes_per_block() == 16 * 30 * per_layer


def test_mixed_layout_sums_its_layers():
    """Layers may differ in dtype, KV heads and head_dim (Gemma-4's full and sliding layers)."""
    layers = (KvLayerShape(KvCacheDtype.BF16, 3, 64),) * 10 + (KvLayerShape(KvCacheDtype.TURBO3, 3, 64),) * 20
    assert KvLayout(layers).bytes_per_token() == 10 * 768 + 20 * 168
    wide = KvLayout((KvLayerShape(KvCacheDtype.FP8, 2, 512), KvLayerShape(KvCacheDtype.BF16, 8, 128)))
    assert wide.bytes_per_token() == 2 * 2 * 512 + 2 * 8 * 128 * 2
    assert formats.side_format(S.TURBO3).bits_per_element(64) == 3.5
    assert formats.side_format(S.TURBO8).bits_per_element(64) == 9


@pytest.mark.parametrize("side", list(SideType), ids=lambda s: s.value)
def test_a_write_whose_slots_are_all_skipped_changes_nothing(side):
    from metrale_cli.kv.formats import new_pool, store

    pool = new_pool(side, 2, 2, 64, torch.device("cpu"))
    before = pool.data.clone()
    store(torch.randn(3, 2, 64, dtype=torch.bfloat16), pool, torch.full((3,), -1, dtype=torch.int32))
    assert torch.equal(pool.data.view(torch.uint8), before.view(torch.uint8))
