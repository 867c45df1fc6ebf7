"""A layer's paged cache: one :class:`SidePool` per side, K and V, and the dtype they store.

Slot ``s`` is block ``s // BLOCK_SIZE``, offset ``s % BLOCK_SIZE``; a negative slot is skipped.
The byte layouts are normative in ``docs/kv-formats.md`` and defined by the torch codecs of
``kv/formats.py`` + ``kv/quant.py``. Every tensor of a pool lives on the activations' device, so
a CUDA graph can capture it (online fp8 calibration rewrites ``scale`` in place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale_cli.kv.dtypes import KvCacheDtype, SideType

BLOCK_SIZE = 16


@dataclass
class SidePool:
    """One layer's cache pool for one side (K or V).

    ``data``: ``(NB, Hk, 16, D)`` bf16 / float8_e4m3fn for BF16 / FP8 sides, ``(NB, block_bytes)``
    uint8 for packed sides (nvfp4, turbo2/3/4/8). ``scale``: ``(1,)`` fp32, the fp8 per-tensor
    scale (stored value = e4m3(x / scale)); 1.0 for the other sides. ``signs``: ``(2, D)`` fp32
    WHT signs (row 0 = S1, row 1 = S2) when the side is stored rotated (turbo), else None.
    ``channel_scale``: ``(Hk, D)`` fp32 InnerQ scales (K side only) multiplied into K after the
    rotation and before quantizing; None = all ones.
    """

    side: SideType
    data: torch.Tensor
    num_kv_heads: int
    head_dim: int
    scale: torch.Tensor
    signs: torch.Tensor | None = None
    channel_scale: torch.Tensor | None = None

    @property
    def rotated(self) -> bool:
        return self.signs is not None

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]


@dataclass
class LayerKv:
    """One layer's cache: the KV dtype, decided once when the cache is built, and its two pools."""

    dtype: KvCacheDtype
    k: SidePool
    v: SidePool

    @property
    def num_kv_heads(self) -> int:
        return self.k.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.k.head_dim
