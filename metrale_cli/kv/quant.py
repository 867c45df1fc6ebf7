"""The torch codecs that define every packed KV side's bytes (docs/kv-formats.md is normative).

Each codec turns vectors ``x: (N, D)`` fp32 (already rotated for turbo sides) into
``(data, scales)`` uint8 tensors ``(N, data_bytes(D))`` and ``(N, D/16 * scale_bytes)``, and
back into fp32 values. Every step that decides a stored bit is plain fp32 with correct rounding
(torch runs each elementwise op on its own, so nothing is fused). Groups are 16 consecutive
elements of one vector; group sums use the warp's xor-butterfly order.
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
GROUP = 16

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_HALF_LEVELS = {
    4: (0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326),
    3: (0.2451, 0.7560, 1.3440, 2.1520),
    2: (0.4528, 1.5104),
}


def _levels(bits: int) -> torch.Tensor:
    half = torch.tensor(_HALF_LEVELS[bits], dtype=torch.float32)
    return torch.cat((-half.flip(0), half))


LEVELS: dict[int, torch.Tensor] = {b: _levels(b) for b in _HALF_LEVELS}
"""The Lloyd-Max levels of N(0, 1) for turbo4 / turbo3 / turbo2, ascending fp32; code = index."""

BOUNDARIES: dict[int, torch.Tensor] = {b: (L[:-1] + L[1:]) / 2 for b, L in LEVELS.items()}
"""``b_k = (L_k + L_{k+1}) / 2`` in fp32; code = #{k : b_k < u}."""


# --- fp32 building blocks -------------------------------------------------------------------
def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 bytes (uint8): round to nearest even, saturate to ±448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def from_e4m3(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).float()


def groups(x: torch.Tensor) -> torch.Tensor:
    """(N, D) -> (N, D/16, 16)."""
    return x.reshape(x.shape[0], x.shape[1] // GROUP, GROUP)


def butterfly_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (16) in xor-shuffle order: for h in 8, 4, 2, 1: v[i] += v[i ^ h]."""
    lane = torch.arange(GROUP, device=v.device)
    for h in (8, 4, 2, 1):
        v = v + v[..., lane ^ h]
    return v[..., 0]


# --- bit packing ------------------------------------------------------------------------------
def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (N, D) integers < 2**bits -> (N, D * bits / 8) uint8, packed little-end first."""
    n = codes.shape[0]
    c = codes.to(torch.int32)
    if bits == 8:
        return c.to(torch.uint8)
    per_word = 8 if bits == 3 else 8 // bits  # 3-bit: 8 codes in a 24-bit word
    word_bytes = per_word * bits // 8
    c = c.reshape(n, -1, per_word)
    word = (c << (bits * torch.arange(per_word, device=c.device))).sum(-1)
    shifts = 8 * torch.arange(word_bytes, device=c.device)
    return ((word[..., None] >> shifts) & 0xFF).to(torch.uint8).reshape(n, -1)


def unpack(data: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`pack`: (N, bytes) uint8 -> (N, D) int64 codes."""
    n = data.shape[0]
    b = data.to(torch.int64)
    if bits == 8:
        return b
    per_word = 8 if bits == 3 else 8 // bits
    word_bytes = per_word * bits // 8
    b = b.reshape(n, -1, word_bytes)
    word = (b << (8 * torch.arange(word_bytes, device=b.device))).sum(-1)
    codes = (word[..., None] >> (bits * torch.arange(per_word, device=b.device))) & ((1 << bits) - 1)
    return codes.reshape(n, head_dim)


# Decode tables live on the data's device, copied there once: a host-to-device copy in every
# call waits for the GPU, and the cuda backend decodes packed contexts on the GPU (sdpa_prefill).
@functools.lru_cache(maxsize=None)
def _e2m1_on(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _levels_on(bits: int, device: torch.device) -> torch.Tensor:
    return LEVELS[bits].to(device)


# --- nvfp4 ------------------------------------------------------------------------------------
def nvfp4_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = groups(x.float())
    s8 = to_e4m3(g.abs().amax(-1) / 6.0)
    s = from_e4m3(s8)[..., None]
    q = g / torch.where(s == 0, torch.ones_like(s), s)
    a = q.abs()
    mag = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
           + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    codes = ((q < 0).int() << 3) | mag
    codes = torch.where(s == 0, torch.zeros_like(codes), codes)
    return pack(codes.reshape(x.shape), 4), s8


def nvfp4_decode(data: torch.Tensor, scales: torch.Tensor, head_dim: int) -> torch.Tensor:
    codes = unpack(data, 4, head_dim)
    table = _e2m1_on(data.device)
    val = table[codes & 7] * (1 - 2 * (codes >> 3)).float()
    return (groups(val) * from_e4m3(scales)[..., None]).reshape(data.shape[0], head_dim)


# --- turbo2 / turbo3 / turbo4 -----------------------------------------------------------------
def codebook_encode(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    levels, bounds = LEVELS[bits].to(x.device), BOUNDARIES[bits].to(x.device)
    g = groups(x.float())
    ss = butterfly_sum(g * g)[..., None]
    rms = torch.sqrt(ss / 16.0)
    u = g / torch.where(ss == 0, torch.ones_like(rms), rms)
    codes = (bounds < u[..., None]).sum(-1)
    codes = torch.where(ss == 0, torch.full_like(codes, len(levels) // 2), codes)
    chosen = levels[codes]
    cn = torch.sqrt(butterfly_sum(chosen * chosen))[..., None]
    s8 = to_e4m3(torch.sqrt(ss) / cn)[..., 0]
    s8 = torch.where(ss[..., 0] == 0, torch.zeros_like(s8), s8)
    return pack(codes.reshape(x.shape), bits), s8


def codebook_decode(data: torch.Tensor, scales: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    codes = unpack(data, bits, head_dim)
    val = _levels_on(bits, data.device)[codes]
    return (groups(val) * from_e4m3(scales)[..., None]).reshape(data.shape[0], head_dim)


# --- turbo8 -----------------------------------------------------------------------------------
def turbo8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = groups(x.float())
    sb = (g.abs().amax(-1) / FP8_MAX).to(torch.bfloat16)
    s = sb.float()[..., None]
    codes = to_e4m3(g / torch.where(s == 0, torch.ones_like(s), s))
    codes = torch.where(s == 0, torch.zeros_like(codes), codes)
    return codes.reshape(x.shape), sb.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def turbo8_decode(data: torch.Tensor, scales: torch.Tensor, head_dim: int) -> torch.Tensor:
    s = scales.contiguous().view(torch.bfloat16).float()
    return (groups(from_e4m3(data)) * s[..., None]).reshape(data.shape[0], head_dim)
