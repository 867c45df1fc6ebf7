"""Chunked prefill attention on tensor cores: torch SDPA over the context gathered from the cache.

The paged prefill kernels (``kernels_cu/prefill_paged.cu``) run on CUDA cores: fine for a few
query tokens, quadratic and slow for a long chunk. For a long chunk the cuda backend gathers the
context ``[0, start_pos + T)`` into contiguous bf16 K and V and calls
``torch.nn.functional.scaled_dot_product_attention``, which runs a flash / cuDNN kernel on an
H200 and the math path on a CPU. Semantics are ``reference.paged_prefill``'s.

Rounding (tolerance: the "attention" row of tests/test_kernels_gpu.py, atol 2e-2, rtol 2e-2):

- bf16 sides are gathered as stored; e4m3 -> bf16 is exact (3 mantissa bits fit in 7).
- The fp8 per-tensor scales stay on the device: k_scale is folded into q (q·k_scale rounded to
  bf16 once, relative error <= 2^-9) and v_scale multiplies the output (one more bf16 rounding).
- Packed sides (nvfp4, turbo2/3/4/8) are decoded by the torch codecs (``kv/formats.load``) to
  fp32 and rounded to bf16 (relative error <= 2^-9 per element).
- The fused kernels accumulate in fp32 but round the softmax probabilities to bf16 before the
  P·V product; the output is rounded to bf16. Together a few 2^-9 relative, well inside 2e-2.

Nothing here reads a device value on the host (no ``.item()``, no boolean-mask indexing, no
per-call host-to-device table copy: the codecs keep their decode tables per device), so the GPU
is never waited on; the block-table slice length is computed from Python ints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale_cli.kv import formats
from metrale_cli.kv.dtypes import SideType
from metrale_cli.kv.pool import BLOCK_SIZE, LayerKv, SidePool

# torch's flash and cuDNN backends read fewer KV heads than query heads (enable_gqa), up to
# head_dim 256. Wider heads only fit the memory-efficient backend, which through torch 2.13
# takes equal head counts only (its docs: GQA "works only for Flash_attention and math kernel on
# CUDA"), so their K / V heads are repeated here rather than leaving the chunk to the math path.
GQA_MAX_HEAD_DIM = 256


def sdpa_prefill(q: torch.Tensor, kv: LayerKv, block_table: torch.Tensor, start_pos: int,
                 scale: float) -> torch.Tensor:
    """Causal attention of one chunk over the cache, as ``PagedAttention.paged_prefill``.

    q: (T, Hq, D) bf16 at positions ``start_pos .. start_pos+T-1`` (rotated and InnerQ-divided
    when the K side is rotated); block_table: (MB,) int32 covering ``start_pos + T`` positions.
    Query t attends to positions ``0 .. start_pos + t``; GQA: query head h reads KV head
    h // (Hq // Hk). Returns (T, Hq, D) in q's dtype, in the V side's basis. CPU or CUDA.
    """
    tokens, hq, head_dim = q.shape
    if tokens == 0:
        return torch.empty_like(q)
    total = start_pos + tokens
    k, k_scale = gather_context(kv.k, block_table, total, q.dtype)
    v, v_scale = gather_context(kv.v, block_table, total, q.dtype)
    if k_scale is not None:
        q = (q * k_scale).to(q.dtype)
    group = hq // k.shape[1]
    if group > 1 and head_dim > GQA_MAX_HEAD_DIM:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    # start 0: a square causal mask, which every backend takes as is_causal; later chunks see
    # the whole cached prefix, i.e. the mask aligned to the bottom-right corner.
    mask = None
    if start_pos:
        from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: ~1.5 s

        mask = causal_lower_right(tokens, total)
    out = F.scaled_dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), attn_mask=mask, is_causal=start_pos == 0,
        scale=scale, enable_gqa=k.shape[1] != hq,
    )[0].transpose(0, 1)
    if v_scale is not None:
        out = (out * v_scale).to(q.dtype)
    return out.contiguous()


def gather_context(pool: SidePool, block_table: torch.Tensor, length: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first ``length`` cached positions as (length, Hk, D) ``dtype`` values, and the fp8
    per-tensor scale ((1,) fp32, still to apply) for an fp8 side, else None."""
    blocks = block_table[: (length + BLOCK_SIZE - 1) // BLOCK_SIZE]
    if pool.side == SideType.BF16:
        return _rows(pool.data, blocks, length).to(dtype), None
    if pool.side == SideType.FP8:  # gathered as bytes: index kernels need not know float8
        raw = _rows(pool.data.view(torch.uint8), blocks, length)
        return raw.view(torch.float8_e4m3fn).to(dtype), pool.scale
    return formats.load(pool, blocks, length).to(dtype), None


def _rows(data: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """(NB, Hk, 16, D) pool, block ids -> its first ``length`` token rows (length, Hk, D)."""
    return formats.token_rows(data.index_select(0, blocks))[:length]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(S, H, D) -> the (1, H, S, D) view SDPA takes; flash and cuDNN read it without a copy."""
    return x.transpose(0, 1).unsqueeze(0)
