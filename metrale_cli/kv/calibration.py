"""The online KV calibrations of a cache, together: fp8 per-tensor scales and InnerQ channel scales.

A layer asks :meth:`KvCalibration.frozen` before it fuses its cache write (the calibration must
see K / V on the host side first) and hands its K / V to :meth:`KvCalibration.observe` until then.
"""

from __future__ import annotations

import torch

from metrale_cli.kv.fp8 import Fp8ScalePolicy
from metrale_cli.kv.innerq import InnerQPolicy


class KvCalibration:
    def __init__(self, fp8: Fp8ScalePolicy, innerq: InnerQPolicy):
        self.fp8, self.innerq = fp8, innerq

    def frozen(self, layer: int) -> bool:
        """Layer ``layer``'s calibrations are done (or never ran)."""
        return bool(self.fp8.frozen[layer]) and bool(self.innerq.frozen[layer])

    @property
    def all_frozen(self) -> bool:
        return all(self.fp8.frozen) and all(self.innerq.frozen)

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Called before a layer's cache write with its roped K and its V: (T, Hk, D)."""
        self.fp8.observe(layer, k, v)
        self.innerq.observe(layer, k, slot_mapping)

    def describe(self) -> list[str]:
        """The lines a run prints once: where the fp8 scales come from, what InnerQ does."""
        return [line for line in (self.fp8.describe(), self.innerq.describe()) if line]
