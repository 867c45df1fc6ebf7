"""PagedKvCache: one :class:`LayerKv` per layer, shared block ids, block tables per sequence.

Layers may differ in KV dtype (high-precision boundary layers keep bf16), in KV heads and in
head_dim; every pool has the same number of blocks, so one block table per sequence serves every
layer. A layer without KV (a Gated DeltaNet layer of a hybrid keeps a recurrent state instead) has
no shape and no pools: ``layers[i]`` is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import KvCacheDtype, kv_pair
from metrale_cli.kv.formats import new_layer_kv, side_format
from metrale_cli.kv.pool import BLOCK_SIZE, LayerKv


@dataclass(frozen=True)
class KvLayerShape:
    """What one layer stores per token: its dtype, KV heads and head_dim."""

    dtype: KvCacheDtype
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self) -> int:
        """Bytes one token occupies in this layer, K and V, group scales included."""
        return sum(self.num_kv_heads * side_format(s).vector_bytes(self.head_dim) for s in kv_pair(self.dtype))


@dataclass(frozen=True)
class KvLayout:
    """The cache's shape: one :class:`KvLayerShape` per layer, None for a layer without KV."""

    layers: tuple[KvLayerShape | None, ...]

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: KvCacheDtype) -> KvLayout:
        return cls((KvLayerShape(dtype, num_kv_heads, head_dim),) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The indices of the layers that hold KV."""
        return tuple(i for i, s in enumerate(self.layers) if s is not None)

    @property
    def dtypes(self) -> tuple[KvCacheDtype | None, ...]:
        """Each layer's KV dtype, None for a layer without KV."""
        return tuple(None if s is None else s.dtype for s in self.layers)

    def layer_bytes_per_token(self, layer: int) -> int:
        s = self.layers[layer]
        return 0 if s is None else s.bytes_per_token()

    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        return sum(s.bytes_per_token() for s in self.layers if s is not None)

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
    """``layers[i]``: layer i's :class:`LayerKv` (its dtype and K / V pools), as ``layout`` says;
    None for a layer without KV."""

    def __init__(self, layout: KvLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.device = device
        self.layers: list[LayerKv | None] = [
            None if s is None else new_layer_kv(s.dtype, num_blocks, s.num_kv_heads, s.head_dim, device)
            for s in layout.layers]
        self.allocator = BlockAllocator(num_blocks)

    def pools(self):
        """Every side pool of the cache, layer by layer, K before V."""
        return [pool for kv in self.layers if kv is not None for pool in (kv.k, kv.v)]

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
