"""One table: KV side type -> how a pool of that side stores, writes and reads its elements.

Element sides (bf16, fp8) keep ``(NB, Hk, 16, D)`` tensors of their element type. Packed sides
keep ``(NB, block_bytes)`` uint8 blocks: the 16 × Hk vectors' data ordered ``[head][token]``,
then their group scales ordered ``[head][token][group]`` (docs/kv-formats.md, "Pools"). Either
way one KV head's 16 tokens of a block lie together: a decode reads one head's span at a time.
:func:`store` and :func:`load` are the torch reference of every cache write and read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from metrale_cli.kv import quant
from metrale_cli.kv.dtypes import KvCacheDtype, SideType, kv_pair
from metrale_cli.kv.pool import BLOCK_SIZE, LayerKv, SidePool
from metrale_cli.kv.wht import rotate_fp32

Encoder = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]
Decoder = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class SideFormat:
    """How one side type stores an element. ``data_bits`` / ``scale_bytes`` describe a packed
    side (per element, per group of 16); ``element`` is the tensor dtype of an element side."""

    side: SideType
    rotated: bool
    element: torch.dtype | None = None
    data_bits: int = 0
    scale_bytes: int = 0
    encode: Encoder | None = None
    decode: Decoder | None = None

    @property
    def packed(self) -> bool:
        return self.element is None

    def data_bytes(self, head_dim: int) -> int:
        return head_dim * self.data_bits // 8

    def vector_bytes(self, head_dim: int) -> int:
        """Bytes one head's vector of one token occupies, group scales included."""
        if not self.packed:
            return head_dim * self.element.itemsize
        return self.data_bytes(head_dim) + head_dim // quant.GROUP * self.scale_bytes

    def bits_per_element(self, head_dim: int) -> float:
        return 8 * self.vector_bytes(head_dim) / head_dim

    def block_bytes(self, num_kv_heads: int, head_dim: int) -> int:
        return BLOCK_SIZE * num_kv_heads * self.vector_bytes(head_dim)

    def pool_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        if self.packed:
            return (num_blocks, self.block_bytes(num_kv_heads, head_dim))
        return (num_blocks, num_kv_heads, BLOCK_SIZE, head_dim)


def _codebook(bits: int) -> tuple[Encoder, Decoder]:
    return (lambda x: quant.codebook_encode(x, bits),
            lambda d, s, head_dim: quant.codebook_decode(d, s, bits, head_dim))


S = SideType
SIDE_FORMATS: dict[SideType, SideFormat] = {
    S.BF16: SideFormat(S.BF16, rotated=False, element=torch.bfloat16),
    S.FP8: SideFormat(S.FP8, rotated=False, element=torch.float8_e4m3fn),
    S.NVFP4: SideFormat(S.NVFP4, False, None, 4, 1, quant.nvfp4_encode, quant.nvfp4_decode),
    S.TURBO4: SideFormat(S.TURBO4, True, None, 4, 1, *_codebook(4)),
    S.TURBO3: SideFormat(S.TURBO3, True, None, 3, 1, *_codebook(3)),
    S.TURBO2: SideFormat(S.TURBO2, True, None, 2, 1, *_codebook(2)),
    S.TURBO8: SideFormat(S.TURBO8, True, None, 8, 2, quant.turbo8_encode, quant.turbo8_decode),
}


def side_format(side: SideType) -> SideFormat:
    return SIDE_FORMATS[side]


# --- the reference write / read ----------------------------------------------------------------
def regions(pool: SidePool) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed pool: data (NB, Hk, 16, data_bytes), scales (NB, Hk, 16, D/16 * sb)."""
    fmt, hk, d = side_format(pool.side), pool.num_kv_heads, pool.head_dim
    split = BLOCK_SIZE * hk * fmt.data_bytes(d)
    nb = pool.data.shape[0]
    data = pool.data[:, :split].view(nb, hk, BLOCK_SIZE, -1)
    scales = pool.data[:, split:].view(nb, hk, BLOCK_SIZE, -1)
    return data, scales


def prepare(x: torch.Tensor, pool: SidePool) -> torch.Tensor:
    """The values a side quantizes: fp32, rotated by R and times channel_scale when set."""
    y = x.float()
    if pool.signs is not None:
        y = rotate_fp32(y, pool.signs)
    if pool.channel_scale is not None:
        y = y * pool.channel_scale.float()
    return y


def store(x: torch.Tensor, pool: SidePool, slot_mapping: torch.Tensor) -> None:
    """Write x: (T, Hk, D) (original basis) into ``pool`` at ``slot_mapping``; slot < 0 skipped."""
    slots = slot_mapping.long()
    keep = slots >= 0
    slots, x = slots[keep], x[keep]
    if not len(slots):  # every slot skipped (already cached): nothing to write
        return
    fmt = side_format(pool.side)
    if pool.side == S.FP8:
        values = (x.float() / pool.scale.float()).clamp(-quant.FP8_MAX, quant.FP8_MAX)
        pool.data[slots // BLOCK_SIZE, :, slots % BLOCK_SIZE] = values.to(torch.float8_e4m3fn)
    elif not fmt.packed:
        pool.data[slots // BLOCK_SIZE, :, slots % BLOCK_SIZE] = x.to(fmt.element)
    else:
        store_prepared(prepare(x, pool), pool, slots)


def store_prepared(values: torch.Tensor, pool: SidePool, slots: torch.Tensor) -> None:
    """Quantize values (n, Hk, D) fp32, already rotated / scaled, into a packed pool at slots >= 0."""
    fmt = side_format(pool.side)
    data, scales = fmt.encode(values.reshape(-1, pool.head_dim))
    data_view, scale_view = regions(pool)
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    data_view[blocks, :, offsets] = data.reshape(*values.shape[:2], -1)
    scale_view[blocks, :, offsets] = scales.reshape(*values.shape[:2], -1)


def load_slots(pool: SidePool, slots: torch.Tensor) -> torch.Tensor:
    """The stored values at ``slots`` (n,) int64 >= 0 of a packed pool: (n, Hk, D) fp32."""
    fmt = side_format(pool.side)
    data_view, scale_view = regions(pool)
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    data = data_view[blocks, :, offsets].reshape(-1, data_view.shape[-1])
    scales = scale_view[blocks, :, offsets].reshape(-1, scale_view.shape[-1])
    return fmt.decode(data, scales, pool.head_dim).reshape(-1, pool.num_kv_heads, pool.head_dim)


def load(pool: SidePool, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached positions of one sequence as stored, dequantized to fp32:
    (length, Hk, D), in the rotated basis (times channel_scale) for a rotated side."""
    nblocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    ids = block_table[:nblocks].long()
    fmt, hk, d = side_format(pool.side), pool.num_kv_heads, pool.head_dim
    if length == 0:
        return torch.zeros(0, hk, d, device=pool.data.device)
    if not fmt.packed:
        flat = token_rows(pool.data[ids])[:length].float()
        return flat * pool.scale.float() if pool.side == S.FP8 else flat
    data_view, scale_view = regions(pool)
    data = token_rows(data_view[ids]).reshape(-1, data_view.shape[-1])
    scales = token_rows(scale_view[ids]).reshape(-1, scale_view.shape[-1])
    return fmt.decode(data, scales, d).reshape(-1, hk, d)[:length]


def token_rows(blocks: torch.Tensor) -> torch.Tensor:
    """(n, Hk, 16, ...) blocks as stored -> (n * 16, Hk, ...) rows in token order (a copy)."""
    return blocks.transpose(1, 2).flatten(0, 1)


def new_pool(side: SideType, num_blocks: int, num_kv_heads: int, head_dim: int,
             device: torch.device) -> SidePool:
    """A zeroed pool; rotated sides carry the WHT signs of their head_dim."""
    from metrale_cli.kv.wht import wht_signs

    fmt = side_format(side)
    dtype = fmt.element if not fmt.packed else torch.uint8
    data = torch.zeros(fmt.pool_shape(num_blocks, num_kv_heads, head_dim), dtype=dtype, device=device)
    signs = wht_signs(head_dim, device) if fmt.rotated else None
    return SidePool(side, data, num_kv_heads, head_dim,
                    torch.ones(1, dtype=torch.float32, device=device), signs)


def new_layer_kv(dtype: KvCacheDtype, num_blocks: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> LayerKv:
    """A zeroed layer cache of ``dtype``: its K and V pools."""
    k, v = (new_pool(side, num_blocks, num_kv_heads, head_dim, device) for side in kv_pair(dtype))
    return LayerKv(dtype, k, v)
