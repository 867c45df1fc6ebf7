"""The randomized Walsh–Hadamard rotation of turbo sides: R = S2 · H · S1 / √D per head.

The torch reference of ``wht_bf16::wht_bf16_inplace[_inv]`` and of the rotation inside a turbo
cache write. The fp32 order of operations is normative (docs/kv-formats.md, "Rotation"): sign
flip, butterflies for h = 1, 2, …, D/2, then ``(y · S2) · c`` with c = fp32(1/√D); the inverse
swaps S1 and S2. R is orthogonal, so rotating both Q and K leaves QKᵀ unchanged.
"""

from __future__ import annotations

import functools
import math

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import HEAD_DIMS

SIGN_SEED = 20251130


@functools.lru_cache(maxsize=None)
def _cpu_signs(head_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SIGN_SEED + head_dim)
    bits = torch.randint(0, 2, (2, head_dim), generator=g)
    return (1 - 2 * bits).float()


def wht_signs(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(2, D) fp32 ±1: row 0 = S1, row 1 = S2, from the fixed seed 20251130 + D."""
    if head_dim not in HEAD_DIMS:
        raise MetraleError(f"turbo KV sides need head_dim in {HEAD_DIMS}, not {head_dim}",
                           hint="choose bf16, fp8 or nvfp4 for this model")
    return _cpu_signs(head_dim).to(device)


def rotate_fp32(x: torch.Tensor, signs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x: (..., D) any float dtype -> R·x (Rᵀ·x when ``inverse``) in fp32, a new tensor."""
    d = x.shape[-1]
    first, last = (signs[1], signs[0]) if inverse else (signs[0], signs[1])
    y = x.float() * first.float()
    lead = y.shape[:-1]
    h = 1
    while h < d:
        pairs = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    c = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)
    return (y * last.float()) * c.to(y.device)


def wht_inplace(x: torch.Tensor, signs: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The reference of ``ops.wht``: x (N, D) rotated in place, rounded once to x's dtype."""
    x.copy_(rotate_fp32(x, signs, inverse).to(x.dtype))
    return x


def hadamard_matrix(head_dim: int, signs: torch.Tensor) -> torch.Tensor:
    """R as a dense (D, D) fp32 matrix (y = R @ x): for tests and readers, not the hot path."""
    return rotate_fp32(torch.eye(head_dim), signs).T
