"""Loaded weights hold no NaN or inf: a corrupt file otherwise loads silently and generates from
NaN logits (empty text that ends as if at end of sequence).

Checked where the weights were loaded to, without copying them: each tensor's min and max (one
pass, no temporary of its size) are NaN or inf exactly when one of its values is. The per-tensor
flags stay on the device and are read once, so the check adds no sync per tensor.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import torch

from metrale_cli.errors import MetraleError

_NAMED = 3  # bad tensors named beyond the first


def _finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on the tensor's device."""
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor)
    return torch.isfinite(low) & torch.isfinite(high)


def check_finite(tensors: Mapping[str, torch.Tensor], files: Mapping[str, pathlib.Path]) -> None:
    """MetraleError naming the first tensor with a NaN or inf value, its file (``files[name]``)
    and how many it holds; the other bad tensors are counted in the same line."""
    if not tensors:
        return
    flags = torch.stack([_finite(t) for t in tensors.values()]).cpu().tolist()
    bad = [name for name, ok in zip(tensors, flags) if not ok]
    if not bad:
        return
    first = tensors[bad[0]]
    count = int((~torch.isfinite(first)).sum())
    more = "" if len(bad) == 1 else (f"; {len(bad) - 1} more tensor(s) have some too: "
                                     + ", ".join(bad[1:1 + _NAMED]) + (", ..." if len(bad) > 1 + _NAMED else ""))
    overflow = " (or, loaded as fp16, its values overflow: try --dtype bf16)" if first.dtype == torch.float16 else ""
    raise MetraleError(f"{files[bad[0]]}: tensor {bad[0]} has {count} non-finite values (NaN or inf){more}",
                       f"the file is corrupt: re-download it{overflow}")
