"""RoPE frequency tables: default, linear, llama3 and YaRN, computed as HF transformers does.

The tables are float32 ``(max_pos, rot_dim // 2)`` cos and sin, already multiplied by the
attention scaling factor (YaRN's mscale), the layout ``Ops.rope`` takes.
"""

from __future__ import annotations

import math

import torch

from metrale_cli.layers.spec import RopeConfig
from metrale_cli.errors import MetraleError


def _base_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (rope.theta**exponents)


def _llama3(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(rope, dim)
    old_len = rope.original_max_position_embeddings or max_pos
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    original = rope.original_max_position_embeddings or max_pos
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def inv_freq_and_scaling(rope: RopeConfig, head_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """(inv_freq: (rot_dim // 2,) float32, attention scaling) for the config's rope type, each
    frequency divided by its ``freq_factors`` entry when the checkpoint gives them (GGUF)."""
    dim = int(head_dim * rope.partial_rotary_factor)
    if rope.rope_type == "llama3":
        inv_freq, scaling = _llama3(rope, dim, max_pos)
    elif rope.rope_type == "yarn":
        inv_freq, scaling = _yarn(rope, dim, max_pos)
    else:
        inv_freq, scaling = _base_inv_freq(rope, dim), 1.0
        if rope.rope_type == "linear":
            inv_freq = inv_freq / rope.factor
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != dim // 2:
            raise MetraleError(f"rope_freqs has {len(rope.freq_factors)} factors; the rotary dimension "
                               f"{dim} needs {dim // 2}")
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return inv_freq, scaling


def rope_tables(
    rope: RopeConfig, head_dim: int, max_pos: int, model_max_pos: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (max_pos, rot_dim // 2) float32 on ``device``."""
    inv_freq, scaling = inv_freq_and_scaling(rope, head_dim, model_max_pos)
    positions = torch.arange(max_pos, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return (freqs.cos() * scaling).to(device), (freqs.sin() * scaling).to(device)
