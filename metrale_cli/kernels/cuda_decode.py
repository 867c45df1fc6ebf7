"""The cuda backend's attention of a decode step: QK-norm + RoPE + cache write, the paged decode
with its split combine, and the three fused into one launch for the bf16 and fp8 caches.
:class:`~metrale_cli.kernels.cuda_ops.CudaOps` takes these methods from :class:`CudaDecodeOps`.
"""

from __future__ import annotations

import functools
import math

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import SidePool
from metrale_cli.kernels.registry import module_for
from metrale_cli.kernels.table import (
    ATTN_THREADS, DECODE_CTAS_PER_SM, MAX_SPLITS, MIN_KEYS_PER_SPLIT, ROPE_AND_CACHE, ROPE_AND_CACHE_WARPS,
    TC_CTAS_PER_SM, TC_MIN_KEYS_PER_SPLIT, TC_PROGRAMMATIC, TC_ROWS, KvKernels, _serves, decode_rows, dtype_of,
    kv_kernels,
)


def _ready(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned, copying only when it is not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _attention_kernels(q: torch.Tensor, k_pool: SidePool, v_pool: SidePool) -> KvKernels:
    hq, head_dim, hk = q.shape[1], q.shape[2], k_pool.num_kv_heads
    if hk == 0 or hq % hk:
        raise MetraleError(f"{hq} query heads cannot share {hk} KV heads evenly")
    if head_dim != k_pool.head_dim:
        raise MetraleError(f"q has head_dim {head_dim}, the KV pools {k_pool.head_dim}")
    return kv_kernels(dtype_of(k_pool, v_pool), head_dim)


def _head_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(T, H, D) whose heads are contiguous within a token (a view into a fused qkv output)
    -> (a contiguous 1-D view from its first element to its last, the token stride), so no
    copy is launched; a copy (``_ready``) only for another layout or a misaligned start."""
    tokens, heads, d = x.shape
    stride = x.stride(0) if tokens > 1 else heads * d
    if (x.stride(2) == 1 and (heads == 1 or x.stride(1) == d) and heads * d <= stride < 2**31
            and x.data_ptr() % 16 == 0):
        return x.as_strided(((tokens - 1) * stride + heads * d,), (1,)), stride
    return _ready(x), heads * d


class CudaDecodeOps:
    """Decode attention on CuPy-launched kernels; needs the host class's ``_launch``."""

    def __init__(self):
        self._counters: dict[int, torch.Tensor] = {}  # per device: the fused decode's combine counters

    def rope_and_cache(self, q, k, v, k_pool: SidePool, v_pool: SidePool, slot_mapping, positions, cos, sin,
                       q_norm, k_norm, eps):
        tokens, hq, head_dim = q.shape
        hk, rot_dim = k.shape[1], cos.shape[-1] * 2
        kernel = ROPE_AND_CACHE[dtype_of(k_pool, v_pool)]
        self._check_rope(kernel, k_pool, hk, head_dim, rot_dim)
        out = torch.empty(tokens, hq, head_dim, dtype=q.dtype, device=q.device)
        if not tokens:
            return out
        (qs, q_stride), (ks, k_stride), (vs, v_stride) = (_head_rows(x) for x in (q, k, v))
        # InnerQ scales belong to a rotated K side; the unfused writes of the other sides ignore them
        channel = k_pool.channel_scale if k_pool.rotated else None
        q_norm, k_norm, channel = (None if t is None else _ready(t) for t in (q_norm, k_norm, channel))
        grid = (tokens, hk + math.ceil(hq / ROPE_AND_CACHE_WARPS))
        self._launch(
            kernel, grid, (32 * ROPE_AND_CACHE_WARPS,), qs, ks, vs, out, k_pool.data, v_pool.data,
            _ready(slot_mapping), _ready(positions), _ready(cos), _ready(sin), q_norm, k_norm, k_pool.scale,
            v_pool.scale, k_pool.signs, v_pool.signs, channel, q_stride, k_stride, v_stride, hq, hk, head_dim,
            rot_dim, eps, pdl=True,
        )
        return out

    @staticmethod
    def _check_rope(kernel, k_pool: SidePool, hk: int, head_dim: int, rot_dim: int) -> None:
        if not _serves(kernel[0], head_dim) or rot_dim > head_dim:
            raise MetraleError(f"{kernel[0]} serves head_dim {module_for(kernel[0]).head_dims} with "
                               f"rot_dim <= head_dim, not head_dim {head_dim}, rot_dim {rot_dim}")
        if (k_pool.num_kv_heads, k_pool.head_dim) != (hk, head_dim):
            raise MetraleError(f"k has {hk} heads of {head_dim}, the KV pools {k_pool.num_kv_heads} of "
                               f"{k_pool.head_dim}")

    def paged_decode(self, q, k_pool: SidePool, v_pool: SidePool, block_tables, seq_lens, scale,
                     tensor_cores: bool = True):
        """The tensor-core kernel where it serves the case (``tensor_cores=False``: the dtype's
        paged_decode_attn kernel always, for its tests), else paged_decode_attn<suffix>."""
        kernels = _attention_kernels(q, k_pool, v_pool)
        batch, hq, head_dim = q.shape
        hk = k_pool.num_kv_heads
        q, out = _ready(q), torch.empty_like(q)
        if not batch:
            return out
        kernel, per_sm, programmatic, min_keys = kernels.decode, DECODE_CTAS_PER_SM, False, MIN_KEYS_PER_SPLIT
        if tensor_cores and kernels.decode_tc is not None:
            kernel, chunks = kernels.decode_tc, math.ceil(hq // hk / TC_ROWS)
            per_sm, min_keys = TC_CTAS_PER_SM[dtype_of(k_pool, v_pool)], TC_MIN_KEYS_PER_SPLIT
            programmatic = dtype_of(k_pool, v_pool) in TC_PROGRAMMATIC
        else:
            chunks = math.ceil(hq // hk / decode_rows(head_dim, hq // hk))
        splits, part_o, part_ml = self._split_buffers(q, hk * batch * chunks, block_tables.shape[1], per_sm, min_keys)
        self._launch(
            kernel, (hk, batch, chunks * splits), (ATTN_THREADS,), q, k_pool.data, v_pool.data,
            _ready(block_tables), _ready(seq_lens), out, part_o, part_ml, k_pool.scale, v_pool.scale,
            scale, hq, hk, head_dim, block_tables.shape[1], splits, pdl=programmatic,
        )
        if splits > 1:
            self._launch(kernels.combine, (hq, batch), (128,), part_o, part_ml, _ready(seq_lens), out, hq,
                         head_dim, splits, pdl=programmatic)
        return out

    def rope_cache_decode(self, q, k, v, k_pool: SidePool, v_pool: SidePool, slot_mapping, positions, cos, sin,
                          q_norm, k_norm, eps, block_tables, seq_lens, scale):
        """One launch (paged_decode_rope_tc<suffix>) where the dtype has it and each sequence brings
        one token, else :meth:`rope_and_cache` then :meth:`paged_decode`: the same bytes either way."""
        kernel = _attention_kernels(q, k_pool, v_pool).decode_rope
        tokens, hq, head_dim = q.shape
        hk, rot_dim = k.shape[1], cos.shape[-1] * 2
        if kernel is None or not tokens or tokens != block_tables.shape[0]:
            q = self.rope_and_cache(q, k, v, k_pool, v_pool, slot_mapping, positions, cos, sin, q_norm, k_norm, eps)
            return self.paged_decode(q, k_pool, v_pool, block_tables, seq_lens, scale)
        self._check_rope(kernel, k_pool, hk, head_dim, rot_dim)
        chunks = math.ceil(hq // hk / TC_ROWS)
        per_sm = TC_CTAS_PER_SM[dtype_of(k_pool, v_pool)]
        splits, part_o, part_ml = self._split_buffers(q, hk * tokens * chunks, block_tables.shape[1], per_sm,
                                                      TC_MIN_KEYS_PER_SPLIT)
        out = torch.empty(tokens, hq, head_dim, dtype=q.dtype, device=q.device)
        (qs, q_stride), (ks, k_stride), (vs, v_stride) = (_head_rows(x) for x in (q, k, v))
        q_norm, k_norm = (None if t is None else _ready(t) for t in (q_norm, k_norm))
        self._launch(
            kernel, (hk, tokens, chunks * splits), (ATTN_THREADS,), qs, ks, vs, k_pool.data, v_pool.data,
            _ready(slot_mapping), _ready(positions), _ready(cos), _ready(sin), q_norm, k_norm, _ready(block_tables),
            _ready(seq_lens), out, part_o, part_ml, self._combine_counters(q.device, tokens * hk * chunks),
            k_pool.scale, v_pool.scale, scale, q_stride, k_stride, v_stride, hq, hk, head_dim, rot_dim,
            block_tables.shape[1], splits, eps, pdl=dtype_of(k_pool, v_pool) in TC_PROGRAMMATIC,
        )
        return out

    def _combine_counters(self, device: torch.device, count: int) -> torch.Tensor:
        """Zeroed int32 words, one per (sequence, KV head, chunk), that every fused launch leaves
        zero: kept per device and grown (never shrunk) so graphs replay on the same buffer."""
        have = self._counters.get(device.index)
        if have is None or have.numel() < count:
            have = self._counters[device.index] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        return have

    def _split_buffers(self, q: torch.Tensor, ctas: int, max_blocks: int, per_sm: int, min_keys: int):
        """(splits, part_o, part_ml) of a decode launch: the partials' fp32 buffers when split."""
        batch, hq, head_dim = q.shape
        splits = self._splits(q.device, ctas, max_blocks, per_sm, min_keys)
        if splits == 1:
            return splits, None, None
        return (splits, torch.empty(batch, hq, splits, head_dim, dtype=torch.float32, device=q.device),
                torch.empty(batch, hq, splits, 2, dtype=torch.float32, device=q.device))

    @staticmethod
    def _splits(device: torch.device, ctas: int, max_blocks: int, per_sm: int = DECODE_CTAS_PER_SM,
                min_keys: int = MIN_KEYS_PER_SPLIT) -> int:
        """Context splits of a decode launch; static per shape (graph-safe). The fewest splits
        whose grid fills its waves of resident CTAs (at least 90% of the last one), else the
        count that fills them best (all allowed ones when the grid stays under one wave); a
        split of the block table's width holds at least ``min_keys`` keys. The kernel cuts each
        live context into splits of at least MIN_KEYS_PER_SPLIT keys (``split_keys`` in
        paged_attention.cuh), so a short context only uses a few of them."""
        slots = _sm_count(device.index) * per_sm
        allowed = max(1, min(MAX_SPLITS, max_blocks * 16 // min_keys))
        best, best_fill = allowed, 0.0
        for splits in range(1, allowed + 1):
            waves = ctas * splits / slots
            fill = waves / max(1, math.ceil(waves))
            if fill >= 0.9:
                return splits
            if fill > best_fill:
                best, best_fill = splits, fill
        return best
