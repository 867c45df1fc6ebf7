"""The cuda backend's paged-cache attention of one KV dtype at one head_dim, its kernels resolved
at build time (:class:`CudaPagedAttention`, from ``CudaOps.paged_attention``): the cache write,
QK-norm + RoPE + write, the paged decode with its split combine, the three fused into one launch
where the dtype has it (bf16 and fp8 at head_dim 64 / 128), and chunked prefill.
"""

from __future__ import annotations

import math

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import cuda_launch
from metrale_cli.kernels.cuda_launch import CudaLauncher, _head_rows, _ready
from metrale_cli.kernels.kv_kernels import KvKernels
from metrale_cli.kernels.loader import clusters_available
from metrale_cli.kernels.registry import TC_HEAD_DIMS
from metrale_cli.kernels.rotation import restore_output
from metrale_cli.kernels.sdpa_prefill import sdpa_prefill
from metrale_cli.kernels.table import (
    ATTN_THREADS, DECODE_CTAS_PER_SM, MAX_SPLITS, MIN_KEYS_PER_SPLIT, ROPE_AND_CACHE_WARPS, SDPA_MIN_TOKENS,
    TC_FEW_SPLITS, TC_LONG_KEYS_PER_SPLIT, TC_MAX_CLUSTER, TC_MIN_KEYS_PER_SPLIT, TC_PAIR_CTAS_PER_SM,
    TC_PRELOAD_MAX_GROUP, TC_ROWS, decode_rows, rows_per_cta,
)
from metrale_cli.kv.dtypes import TensorCoreDecode
from metrale_cli.kv.pool import LayerKv


class CudaPagedAttention:
    """:class:`~metrale_cli.kernels.ops.PagedAttention` on CuPy-launched kernels (shapes there)."""

    def __init__(self, ops: CudaLauncher, kernels: KvKernels):
        self.ops, self.kernels = ops, kernels
        self.dtype, self.head_dim = kernels.dtype, kernels.head_dim
        self.tc = kernels.dtype.row.tensor_core  # the tensor-core decode's launch facts, or None

    def _check(self, kv: LayerKv, hq: int | None = None, head_dim: int | None = None) -> None:
        if kv.dtype != self.dtype or kv.head_dim != self.head_dim:
            raise MetraleError(f"a {kv.dtype.value} cache of head_dim {kv.head_dim} was given to the "
                               f"{self.dtype.value} attention of head_dim {self.head_dim}")
        if hq is not None and (kv.num_kv_heads == 0 or hq % kv.num_kv_heads):
            raise MetraleError(f"{hq} query heads cannot share {kv.num_kv_heads} KV heads evenly")
        if head_dim is not None and head_dim != self.head_dim:
            raise MetraleError(f"q has head_dim {head_dim}, the KV pools {self.head_dim}")

    def _programmatic(self, batch: int) -> bool:
        """Whether the tensor-core decode of ``batch`` sequences launches programmatically: where
        its row says so, at batch 1 only. A batch's projections (gemm_rows.cu) let the next launch in
        as soon as they have read x, and the decode's grid, sized to one wave, then waited beside
        them: bf16 at batch 16 and 32k 723.2 -> 629.3 tok/s on an H200 (docs/performance.md)."""
        return self.tc.programmatic and batch == 1

    def reshape_and_cache(self, k, v, kv: LayerKv, slot_mapping):
        tokens, hk, head_dim = k.shape
        self._check(kv, head_dim=head_dim)
        if not tokens:
            return
        channel = kv.k.channel_scale
        values = dict(
            k=_ready(k), v=_ready(v), k_cache=kv.k.data, v_cache=kv.v.data, slot_mapping=_ready(slot_mapping),
            k_scale=kv.k.scale, v_scale=kv.v.scale, k_signs=kv.k.signs, v_signs=kv.v.signs,
            channel_scale=None if channel is None else _ready(channel), hk=hk, head_dim=head_dim,
        )
        spec, sig = self.kernels.write
        grid, block = ((tokens, hk), (64,)) if self.dtype.row.write.per_head else ((tokens,), (128,))
        self.ops.loader.launch(spec, sig, grid, block, *(values[name] for name, _ in sig.params))

    def rope_and_cache(self, q, k, v, kv: LayerKv, slot_mapping, positions, cos, sin, q_norm, k_norm, eps,
                       rotate_q=False):
        tokens, hq, head_dim = q.shape
        hk, rot_dim = k.shape[1], cos.shape[-1] * 2
        self._check_rope(kv, hk, head_dim, rot_dim)
        out = torch.empty(tokens, hq, head_dim, dtype=q.dtype, device=q.device)
        if not tokens:
            return out
        (qs, q_stride), (ks, k_stride), (vs, v_stride) = (_head_rows(x) for x in (q, k, v))
        # InnerQ scales belong to a rotated K side; the unfused writes of the other sides ignore them
        channel = kv.k.channel_scale if kv.k.rotated else None
        q_norm, k_norm, channel = (None if t is None else _ready(t) for t in (q_norm, k_norm, channel))
        grid = (tokens, hk + math.ceil(hq / ROPE_AND_CACHE_WARPS))
        self.ops._launch(
            self.kernels.rope_write, grid, (32 * ROPE_AND_CACHE_WARPS,), qs, ks, vs, out, kv.k.data, kv.v.data,
            _ready(slot_mapping), _ready(positions), _ready(cos), _ready(sin), q_norm, k_norm, kv.k.scale,
            kv.v.scale, kv.k.signs, kv.v.signs, channel, q_stride, k_stride, v_stride, hq, hk, head_dim,
            rot_dim, eps, int(rotate_q and kv.k.rotated), pdl=True,
        )
        return out

    def _check_rope(self, kv: LayerKv, hk: int, head_dim: int, rot_dim: int) -> None:
        self._check(kv, head_dim=head_dim)
        if rot_dim > head_dim:
            raise MetraleError(f"RoPE rotates {rot_dim} dims of a {head_dim}-wide head")
        if kv.num_kv_heads != hk:
            raise MetraleError(f"k has {hk} heads, the KV pools {kv.num_kv_heads}")

    def paged_decode(self, q, kv: LayerKv, block_tables, seq_lens, scale, restore_v=False,
                     tensor_cores: bool = True, pair: bool | None = None):
        """The tensor-core kernel where it serves the case (``tensor_cores=False``: the dtype's
        paged_decode_attn kernel always, for its tests), else paged_decode_attn<suffix>; its
        batch-1 pair entry where the dtype has one and the grid fits it (``pair`` True / False: that
        entry or the other, for their checks). A split context is combined inside the tensor-core
        launch, else by paged_decode_combine<suffix>. With ``restore_v`` a rotated V side's output
        comes back rotated by that combine (or, with one split, by the WHT launch)."""
        batch, hq, head_dim = q.shape
        self._check(kv, hq, head_dim)
        hk = kv.num_kv_heads
        q, out = _ready(q), torch.empty_like(q)
        if not batch:
            return out
        restore = restore_v and kv.v.rotated
        kernel, programmatic = self.kernels.decode, False
        tc = tensor_cores and self.kernels.decode_tc is not None
        if tc:
            kernel, chunks, programmatic = self.kernels.decode_tc, math.ceil(hq // hk / TC_ROWS), self._programmatic(batch)
            splits = tc_decode_splits(q.device, hk * batch * chunks, block_tables.shape[1], self.tc)
            if self._pair(pair, q.device, hk * batch * chunks * splits, block_tables.shape[1], splits):
                kernel = self.kernels.decode_tc_pair
        else:
            chunks = math.ceil(hq // hk / decode_rows(head_dim, hq // hk))
            splits = decode_splits(q.device, hk * batch * chunks, block_tables.shape[1])
        part_o, part_ml = _split_buffers(q, splits)
        v_signs = kv.v.signs if restore and splits > 1 else None
        # the tensor-core decode combines its own splits (counters), the other one's go to the combine
        counters = self.ops.combine_counters(q.device, batch * hk * chunks) if tc and splits > 1 else None
        self.ops._launch(
            kernel, (hk, batch, chunks * splits), (ATTN_THREADS,), q, kv.k.data, kv.v.data,
            _ready(block_tables), _ready(seq_lens), out, part_o, part_ml, kv.k.scale, kv.v.scale,
            scale, hq, hk, head_dim, block_tables.shape[1], splits, *((counters, v_signs) if tc else ()),
            pdl=programmatic,
        )
        if splits > 1 and not tc:
            self.ops._launch(self.kernels.combine, (hq, batch), (128,), part_o, part_ml, _ready(seq_lens), out, hq,
                             head_dim, splits, v_signs, pdl=programmatic)
        if splits == 1 and restore:
            out = restore_output(self.ops, out, kv.v)
        return out

    def _pair(self, asked: bool | None, device: torch.device, ctas: int, max_blocks: int, splits: int) -> bool:
        """Whether a tensor-core decode launch takes the dtype's batch-1 pair entry: ``asked`` where
        given (the checks), else where :func:`pair_fits`."""
        if asked is None:
            return self.kernels.decode_tc_pair is not None and pair_fits(device, ctas, max_blocks, splits)
        if asked and self.kernels.decode_tc_pair is None:
            raise MetraleError(f"{self.dtype.value} has no batch-1 pair decode at head_dim {self.head_dim}")
        return asked

    def rope_cache_decode(self, q, k, v, kv: LayerKv, slot_mapping, positions, cos, sin, q_norm, k_norm, eps,
                          block_tables, seq_lens, scale, preload: bool | None = None):
        """One launch (paged_decode_rope_tc<suffix>) where the dtype has it (bf16, fp8: no rotated
        side) and each sequence brings one token, else :meth:`rope_and_cache` (``rotate_q``) then
        :meth:`paged_decode` (``restore_v``): the same bytes either way. ``preload``: whether the
        one launch is the entry that loads each warp's first tile before its wait (the same bytes);
        None: where :func:`preload_fits`."""
        tokens, hq, head_dim = q.shape
        hk, rot_dim = k.shape[1], cos.shape[-1] * 2
        if preload is None:
            preload = preload_fits(tokens, hq // hk, head_dim)
        kernel = self.kernels.decode_rope_preload if preload else self.kernels.decode_rope
        if kernel is None or not tokens or tokens != block_tables.shape[0]:
            q = self.rope_and_cache(q, k, v, kv, slot_mapping, positions, cos, sin, q_norm, k_norm, eps, rotate_q=True)
            return self.paged_decode(q, kv, block_tables, seq_lens, scale, restore_v=True)
        self._check_rope(kv, hk, head_dim, rot_dim)
        chunks = math.ceil(hq // hk / TC_ROWS)
        splits = tc_decode_splits(q.device, hk * tokens * chunks, block_tables.shape[1], self.tc)
        part_o, part_ml = _split_buffers(q, splits)
        cluster = rope_decode_cluster(q.device, hk * tokens * chunks, splits)
        out = torch.empty(tokens, hq, head_dim, dtype=q.dtype, device=q.device)
        (qs, q_stride), (ks, k_stride), (vs, v_stride) = (_head_rows(x) for x in (q, k, v))
        q_norm, k_norm = (None if t is None else _ready(t) for t in (q_norm, k_norm))
        self.ops._launch(
            kernel, (hk, tokens, chunks * splits), (ATTN_THREADS,), qs, ks, vs, kv.k.data, kv.v.data,
            _ready(slot_mapping), _ready(positions), _ready(cos), _ready(sin), q_norm, k_norm, _ready(block_tables),
            _ready(seq_lens), out, part_o, part_ml, self.ops.combine_counters(q.device, tokens * hk * chunks),
            kv.k.scale, kv.v.scale, scale, q_stride, k_stride, v_stride, hq, hk, head_dim, rot_dim,
            block_tables.shape[1], splits, eps, pdl=self._programmatic(tokens), cluster=(1, 1, cluster),
        )
        return out

    def paged_prefill(self, q, kv: LayerKv, block_table, start_pos, scale, use_kernel: bool = False):
        """Chunks of SDPA_MIN_TOKENS or more tokens go to :func:`sdpa_prefill`; shorter ones, and
        any chunk when ``use_kernel`` (kernel tests), to the dtype's paged prefill kernel."""
        tokens, hq, head_dim = q.shape
        self._check(kv, hq, head_dim)
        if tokens >= SDPA_MIN_TOKENS and not use_kernel:
            return sdpa_prefill(q, kv, block_table, start_pos, scale)
        hk = kv.num_kv_heads
        q, out = _ready(q), torch.empty_like(q)
        if tokens:
            rows = math.ceil(tokens * (hq // hk) / rows_per_cta(head_dim))
            if rows > 65535:
                raise MetraleError(
                    f"prefill chunk of {tokens} tokens is too long for one launch",
                    hint="prefill in chunks of at most 8192 tokens",
                )
            self.ops._launch(
                self.kernels.prefill, (hk, rows), (ATTN_THREADS,), q, kv.k.data, kv.v.data,
                _ready(block_table), out, kv.k.scale, kv.v.scale, scale, tokens, start_pos, hq, hk, head_dim,
            )
        return out


def _split_buffers(q: torch.Tensor, splits: int):
    """(part_o, part_ml) of a decode launch split ``splits`` ways: the partials' fp32 buffers, or
    None when unsplit."""
    if splits == 1:
        return None, None
    batch, hq, head_dim = q.shape
    return (torch.empty(batch, hq, splits, head_dim, dtype=torch.float32, device=q.device),
            torch.empty(batch, hq, splits, 2, dtype=torch.float32, device=q.device))


def preload_fits(tokens: int, group: int, head_dim: int) -> bool:
    """Whether a one-launch decode of ``tokens`` sequences with ``group`` query heads a KV head
    takes the entry that loads each warp's first tile before its wait: batch 1, at most
    TC_PRELOAD_MAX_GROUP query heads a KV head, a head a warp (paged_decode_tc's head dims: 64
    and 128), where it measured faster."""
    return tokens == 1 and group <= TC_PRELOAD_MAX_GROUP and head_dim in TC_HEAD_DIMS


def pair_fits(device: torch.device, ctas: int, max_blocks: int, splits: int) -> bool:
    """Whether the batch-1 pair entry serves a tensor-core decode of ``ctas`` CTAs over a block
    table ``max_blocks`` wide split ``splits`` ways: where the grid is one wave of it
    (TC_PAIR_CTAS_PER_SM an SM) and a split of the table holds TC_LONG_KEYS_PER_SPLIT keys or more
    (four tiles a warp: the long contexts it was measured at; a warp of one tile would pair it
    with a tile of zeros)."""
    return (ctas <= TC_PAIR_CTAS_PER_SM * cuda_launch._sm_count(device.index)
            and max_blocks * 16 >= splits * TC_LONG_KEYS_PER_SPLIT)


def rope_decode_cluster(device: torch.device, items: int, splits: int) -> int:
    """The cluster size of a one-launch decode of ``items`` (sequence, KV head, chunk) triples
    split ``splits`` ways: the splits of an item as one cluster, combining through distributed
    shared memory (no partials in global memory, no counter), when they are 2 to TC_MAX_CLUSTER
    and the grid has at most one CTA an SM (batch 1 at short and middle contexts, where the
    combine is on the step's critical path); else 1 (the last split combines, by counter)."""
    few = 1 < splits <= TC_MAX_CLUSTER and items * splits <= cuda_launch._sm_count(device.index)
    return splits if few and clusters_available(device.index) else 1


def tc_decode_splits(device: torch.device, ctas: int, max_blocks: int, tc: TensorCoreDecode) -> int:
    """:func:`decode_splits` of a tensor-core decode launch (either path: the same count, so the
    one launch and the launches it replaces sum alike)."""
    return decode_splits(device, ctas, max_blocks, tc.ctas_per_sm, TC_MIN_KEYS_PER_SPLIT, tc.max_splits,
                         TC_LONG_KEYS_PER_SPLIT)


def decode_splits(device: torch.device, ctas: int, max_blocks: int, per_sm: int = DECODE_CTAS_PER_SM,
                  min_keys: int = MIN_KEYS_PER_SPLIT, most: int = MAX_SPLITS, long_keys: int = 0) -> int:
    """Context splits of a decode launch; static per shape (graph-safe). The fewest splits whose
    grid fills its waves of resident CTAs (at least 90% of the last one), else the count that
    fills them best (all allowed ones when the grid stays under one wave); a split of the block
    table's width holds at least ``min_keys`` keys, and there are at most ``most`` (the combine's
    limit: MAX_SPLITS; a tensor-core decode's ``max_splits``, up to TC_MAX_SPLITS). With
    ``long_keys`` (the tensor-core decodes) a split holds at least that many keys once there are
    more than TC_FEW_SPLITS. The kernel cuts each live context into splits
    of at least MIN_KEYS_PER_SPLIT keys (``split_keys`` in paged_attention.cuh), so a short
    context only uses a few of them."""
    slots = cuda_launch._sm_count(device.index) * per_sm
    allowed = max(1, min(most, max_blocks * 16 // min_keys))
    if long_keys:
        allowed = min(allowed, max(TC_FEW_SPLITS, max_blocks * 16 // long_keys))
    best, best_fill = allowed, 0.0
    for splits in range(1, allowed + 1):
        waves = ctas * splits / slots
        fill = waves / max(1, math.ceil(waves))
        if fill >= 0.9:
            return splits
        if fill > best_fill:
            best, best_fill = splits, fill
    return best
