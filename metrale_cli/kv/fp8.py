"""Per-tensor fp8 KV scales: from the checkpoint, else online calibration, else 1.0.

Online calibration observes the first write of each layer (up to N tokens), sets
scale = amax / 448 and freezes it: every later token is stored with that scale, so no position
is ever read back with a scale other than the one it was written with.
"""

from __future__ import annotations

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import SideType
from metrale_cli.kv.paged import PagedKvCache
from metrale_cli.kv.quant import FP8_MAX

FP8_CALIBRATION_TOKENS = 256  # --fp8-kv-calibration-tokens' default

# Checkpoint tensor names that carry per-layer KV scales (vLLM / compressed-tensors / ModelOpt).
SCALE_NAMES = {
    "k": ("self_attn.k_scale", "self_attn.attn.k_scale", "self_attn.kv_scale"),
    "v": ("self_attn.v_scale", "self_attn.attn.v_scale", "self_attn.kv_scale"),
}


def checkpoint_scales(tensors: dict[str, torch.Tensor], layer: int, side: str) -> torch.Tensor | None:
    """The checkpoint's per-tensor scale of one side of a layer, as a (1,) fp32 tensor, or None.
    A scale that is not one finite positive number would store every position wrongly: refused."""
    for suffix in SCALE_NAMES[side]:
        name = f"model.layers.{layer}.{suffix}"
        t = tensors.get(name)
        if t is None:
            continue
        value = t.detach().float().reshape(-1)
        if value.numel() != 1 or not bool(torch.isfinite(value).all()) or not bool((value > 0).all()):
            shown = f"{value.item():g}" if value.numel() == 1 else f"{value.numel()} values"
            raise MetraleError(f"the checkpoint's fp8 KV scale {name} is {shown}: it must be one finite "
                               "positive number", hint="fix the checkpoint, or use another --kv-cache-dtype")
        return value
    return None


class Fp8ScalePolicy:
    """Decides and applies the scale source for every fp8 side of a cache (``pool.scale``);
    says which, once. Layers without an fp8 side are frozen from the start."""

    def __init__(self, cache: PagedKvCache, tensors: dict[str, torch.Tensor], calibration_tokens: int):
        self.cache = cache
        layers = range(cache.layout.num_layers)
        self.fp8_sides = [(i, side) for i in layers if cache.layers[i] is not None for side in "kv"
                          if self._pool(i, side).side == SideType.FP8]
        self.calibration_tokens = calibration_tokens
        self.frozen = [not any(i == j for j, _ in self.fp8_sides) for i in layers]
        self.source = self._load(tensors) if self.fp8_sides else None

    def _pool(self, layer: int, side: str):
        return getattr(self.cache.layers[layer], side)

    def _load(self, tensors: dict[str, torch.Tensor]) -> str:
        found = 0
        for layer, side in self.fp8_sides:
            t = checkpoint_scales(tensors, layer, side)
            if t is not None:
                self._pool(layer, side).scale.copy_(t)
                found += 1
        if found == len(self.fp8_sides):
            self.frozen = [True] * len(self.frozen)
            return "checkpoint"
        if found:
            self.frozen = [True] * len(self.frozen)
            return "partial-checkpoint"
        if self.calibration_tokens > 0:
            return "calibration"
        self.frozen = [True] * len(self.frozen)
        return "default"

    def describe(self) -> str | None:
        if self.source is None:
            return None
        return {
            "checkpoint": "fp8 KV scales: from the checkpoint",
            "partial-checkpoint": "fp8 KV scales: the checkpoint has them for some layers only; "
            "the others use 1.0",
            "calibration": f"fp8 KV scales: online calibration over each layer's first write, at most "
            f"{self.calibration_tokens} tokens (amax/448, then frozen)",
            "default": "fp8 KV scales: 1.0 (checkpoint has none; calibration off)",
        }[self.source]

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Called before a layer's cache write; calibrates on the first call, then freezes."""
        if self.frozen[layer]:
            return
        n = self.calibration_tokens
        for side, x in (("k", k), ("v", v)):
            if (layer, side) in self.fp8_sides:
                amax = x[:n].detach().abs().amax().float().clamp(min=1e-4)
                self._pool(layer, side).scale.copy_((amax / FP8_MAX).reshape(1))
        self.frozen[layer] = True
