"""PagedKvCache: one block pool per layer and per side, shared block ids, block tables per sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import BLOCK_SIZE
from metrale_cli.kv.dtypes import KvCacheDtype, SideType, kv_pair

# The side types this build can store; the others arrive with their kernels.
STORAGE_DTYPES: dict[SideType, torch.dtype] = {
    SideType.BF16: torch.bfloat16,
    SideType.FP8: torch.float8_e4m3fn,
}


def storage_dtype(side: SideType) -> torch.dtype:
    if side not in STORAGE_DTYPES:
        raise MetraleError(
            f"KV side type '{side.value}' has no cache storage in this build",
            hint="supported now: " + ", ".join(s.value for s in STORAGE_DTYPES),
        )
    return STORAGE_DTYPES[side]


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KvCacheDtype

    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        k, v = kv_pair(self.dtype)
        per_side = self.num_kv_heads * self.head_dim
        sides = storage_dtype(k).itemsize + storage_dtype(v).itemsize
        return self.num_layers * per_side * sides

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
    """K and V pools ``(num_blocks, 16, Hk, D)`` per layer, plus fp8 per-tensor scales.

    Scales are float32 tensors of shape (1,) per layer and side (1.0 for bf16 sides).
    """

    def __init__(self, layout: KvLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.device = device
        k_side, v_side = kv_pair(layout.dtype)
        shape = (num_blocks, BLOCK_SIZE, layout.num_kv_heads, layout.head_dim)
        self.k = [torch.zeros(shape, dtype=storage_dtype(k_side), device=device) for _ in range(layout.num_layers)]
        self.v = [torch.zeros(shape, dtype=storage_dtype(v_side), device=device) for _ in range(layout.num_layers)]
        self.k_scale = [torch.ones(1, dtype=torch.float32, device=device) for _ in range(layout.num_layers)]
        self.v_scale = [torch.ones(1, dtype=torch.float32, device=device) for _ in range(layout.num_layers)]
        self.allocator = BlockAllocator(num_blocks)

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
