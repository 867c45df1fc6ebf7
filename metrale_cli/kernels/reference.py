"""Torch references of every kernel: the oracle for kernel tests and the ``torch`` backend.

Plain and readable on purpose. Norms and RoPE reproduce HF transformers' rounding order in the
model dtype so the torch backend tracks HF token for token; attention upcasts to fp32.
"""

from __future__ import annotations

import torch

from metrale_cli.kernels.ops import BLOCK_SIZE

FP8_MAX = 448.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return rms_norm(s, weight, eps), s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q, k, positions, cos, sin):
    rot = cos.shape[-1] * 2
    pos = positions.long()
    c = torch.cat((cos[pos], cos[pos]), dim=-1).to(q.dtype).unsqueeze(1)  # (T, 1, rot)
    s = torch.cat((sin[pos], sin[pos]), dim=-1).to(q.dtype).unsqueeze(1)

    def apply(x):
        xr, xp = x[..., :rot], x[..., rot:]
        return torch.cat((xr * c + _rotate_half(xr) * s, xp), dim=-1)

    return apply(q), apply(k)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale), round to nearest even, saturated to ±448."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _store(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if cache.dtype == torch.float8_e4m3fn:
        return quantize_fp8(x, scale)
    return x.to(cache.dtype)


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    k_cache[blocks, offsets] = _store(k[keep], k_cache, k_scale)
    v_cache[blocks, offsets] = _store(v[keep], v_cache, v_scale)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int, scale) -> torch.Tensor:
    """The first ``length`` cached positions of one sequence, dequantized: (length, Hk, D) fp32."""
    nblocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    blocks = cache[block_table[:nblocks].long()]  # (nb, 16, Hk, D)
    flat = blocks.reshape(-1, *cache.shape[2:])[:length].float()
    if cache.dtype == torch.float8_e4m3fn:
        flat = flat * scale.float()
    return flat


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask) -> torch.Tensor:
    """q: (T, Hq, D), k/v: (S, Hk, D) fp32; mask: (T, S) bool of allowed positions or None."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, v).to(q.dtype)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale):
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        k = gather_context(k_cache, block_tables[b], length, k_scale)
        v = gather_context(v_cache, block_tables[b], length, v_scale)
        out[b] = attention(q[b : b + 1], k, v, scale, None)[0]
    return out


def paged_prefill(q, k_cache, v_cache, block_table, start_pos, scale, k_scale, v_scale):
    total = start_pos + q.shape[0]
    k = gather_context(k_cache, block_table, total, k_scale)
    v = gather_context(v_cache, block_table, total, v_scale)
    qpos = torch.arange(start_pos, total, device=q.device)[:, None]
    kpos = torch.arange(total, device=q.device)[None, :]
    return attention(q, k, v, scale, kpos <= qpos)


class TorchOps:
    """The pure-torch backend: runs on CPU or GPU."""

    name = "torch"
    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rope = staticmethod(rope)
    silu_and_mul = staticmethod(silu_and_mul)
    reshape_and_cache = staticmethod(reshape_and_cache)
    paged_decode = staticmethod(paged_decode)
    paged_prefill = staticmethod(paged_prefill)
