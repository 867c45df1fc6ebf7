"""PagedKvCache: one SidePool per layer and per side, shared block ids, block tables per sequence.

Layers may differ in KV dtype (high-precision boundary layers keep bf16); every pool has the
same number of blocks, so one block table per sequence serves every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import BLOCK_SIZE, SidePool
from metrale_cli.kv.dtypes import KvCacheDtype, kv_pair
from metrale_cli.kv.formats import new_pool, side_format


@dataclass(frozen=True)
class KvLayout:
    """The cache's shape: one KV dtype per layer (``dtypes``), one head count and head_dim."""

    num_kv_heads: int
    head_dim: int
    dtypes: tuple[KvCacheDtype, ...]

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: KvCacheDtype) -> KvLayout:
        return cls(num_kv_heads, head_dim, (dtype,) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.dtypes)

    def layer_bytes_per_token(self, layer: int) -> int:
        """Bytes one token occupies in one layer, K and V, group scales included."""
        return sum(self.num_kv_heads * side_format(s).vector_bytes(self.head_dim)
                   for s in kv_pair(self.dtypes[layer]))

    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        return sum(self.layer_bytes_per_token(i) for i in range(self.num_layers))

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * BLOCK_SIZE


def blocks_for(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_SIZE)


class BlockAllocator:
    """A free list of block ids; allocation failure is the user-facing 'pool exhausted' error."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MetraleError(
                f"KV cache pool exhausted: need {count} more blocks of {BLOCK_SIZE} tokens, "
                f"{len(self._free)} free of {self.num_blocks}",
                hint="lower --max-new-tokens or the number of prompts, or raise --max-seq-len / "
                "--gpu-memory-utilization",
            )
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKvCache:
    """``k[i]`` / ``v[i]``: layer i's :class:`SidePool` for K and V, in that layer's side types."""

    def __init__(self, layout: KvLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.device = device
        self.k: list[SidePool] = []
        self.v: list[SidePool] = []
        for dtype in layout.dtypes:
            k_side, v_side = kv_pair(dtype)
            self.k.append(new_pool(k_side, num_blocks, layout.num_kv_heads, layout.head_dim, device))
            self.v.append(new_pool(v_side, num_blocks, layout.num_kv_heads, layout.head_dim, device))
        self.allocator = BlockAllocator(num_blocks)

    def pools(self, layer: int) -> tuple[SidePool, SidePool]:
        return self.k[layer], self.v[layer]

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * BLOCK_SIZE

    def ensure_capacity(self, block_table: list[int], tokens: int) -> None:
        """Grow ``block_table`` in place so it covers ``tokens`` positions."""
        missing = blocks_for(tokens) - len(block_table)
        if missing > 0:
            block_table.extend(self.allocator.allocate(missing))

    def release(self, block_table: list[int]) -> None:
        self.allocator.release(block_table)
        block_table.clear()
