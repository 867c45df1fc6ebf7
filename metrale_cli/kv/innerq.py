"""InnerQ: per-channel equalisation of a rotated K side (KV_DTYPES.md, "InnerQ").

Calibration accumulates Σk² per KV head and channel of the ROTATED K over the first N tokens a
layer writes; then rms_i = sqrt(Σk²/N), s_i = clamp((mean(rms)/rms_i)^α, 0.5, 2) (mean over the
head's channels, α = strength). K is stored times s and Q is divided by s, so QKᵀ is unchanged
while the quantizer sees flatter channels. When every ratio mean/rms_i is within 1.2× the layer
is skipped (its scales stay None). Positions written before the scales freeze were stored with
s = 1: at the freeze they are re-quantized with s, so no position is ever read with the wrong
scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale_cli.kv import formats
from metrale_cli.kv.paged import PagedKvCache
from metrale_cli.kv.wht import rotate_fp32

SKIP_WITHIN = 1.2
CLAMP = (0.5, 2.0)


@dataclass(frozen=True)
class InnerQSettings:
    """``tokens``: calibration length (0 = off); ``strength``: the exponent α."""

    tokens: int = 0
    strength: float = 0.5


def channel_scales(sumsq: torch.Tensor, count: int, strength: float) -> torch.Tensor | None:
    """(Hk, D) scales from per-channel Σk², or None when every channel is within 1.2× of the mean."""
    rms = torch.sqrt(sumsq / max(count, 1))
    ratio = rms.mean(-1, keepdim=True) / rms.clamp(min=1e-12)
    if bool(((ratio <= SKIP_WITHIN) & (ratio >= 1 / SKIP_WITHIN)).all()):
        return None
    return ratio.pow(strength).clamp(*CLAMP)


class InnerQPolicy:
    """Calibrates and applies InnerQ on every layer whose K side is rotated; says what it did."""

    def __init__(self, cache: PagedKvCache, settings: InnerQSettings):
        self.cache = cache
        self.settings = settings
        self.layers = [i for i, kv in enumerate(cache.layers) if kv is not None and kv.k.rotated]
        on = settings.tokens > 0 and bool(self.layers)
        self.frozen = [not (on and i in self.layers) for i in range(cache.layout.num_layers)]
        self.applied: dict[int, bool] = {}
        self._sumsq = {i: torch.zeros(cache.layers[i].num_kv_heads, cache.layers[i].head_dim, device=cache.device)
                       for i in self.layers}
        self._count = dict.fromkeys(self.layers, 0)
        self._written: dict[int, list[torch.Tensor]] = {i: [] for i in self.layers}

    def describe(self) -> str | None:
        if self.settings.tokens <= 0:
            if self.settings.strength == InnerQSettings.strength:
                return None
            return (f"InnerQ: off, so strength {self.settings.strength:g} (TURBO_INNERQ_STRENGTH) has no effect: "
                    "it needs --innerq-calibration-tokens N or TURBO_INNERQ=N")
        if not self.layers:
            return "InnerQ: off (it equalises a rotated K side; no layer's K side is rotated)"
        return (f"InnerQ: calibrating K channel scales over the first {self.settings.tokens} tokens "
                f"(strength {self.settings.strength:g}) on {len(self.layers)} layer(s), then frozen")

    def outcome(self) -> str | None:
        """At a run's end: on how many layers the scales apply and how many were skipped, or that
        the run wrote too few tokens for the calibration to end (none apply then)."""
        waiting = [i for i in self.layers if not self.frozen[i]]
        if waiting:
            seen = min(self._count[i] for i in waiting)
            return (f"InnerQ: not calibrated: the cache took {seen} of the {self.settings.tokens} tokens the "
                    "calibration reads, so no scales apply yet (a smaller --innerq-calibration-tokens or a "
                    "longer run)")
        if not self.applied:
            return None
        used = sum(self.applied.values())
        return (f"InnerQ: scales applied on {used} layer(s), skipped on {len(self.applied) - used} "
                f"(every channel within {SKIP_WITHIN}x of the mean)")

    def observe(self, layer: int, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Called before a layer's cache write with its K: (T, Hk, D); freezes once N are seen."""
        if self.frozen[layer]:
            return
        slots = slot_mapping.long()
        keep = slots >= 0
        take = min(int(keep.sum()), self.settings.tokens - self._count[layer])
        rotated = rotate_fp32(k[keep][:take], self.cache.layers[layer].k.signs)
        self._sumsq[layer] += rotated.pow(2).sum(0)
        self._count[layer] += take
        if self._count[layer] >= self.settings.tokens:
            self._freeze(layer)
        else:
            self._written[layer].append(slots[keep])

    def _freeze(self, layer: int) -> None:
        pool = self.cache.layers[layer].k
        scales = channel_scales(self._sumsq[layer], self._count[layer], self.settings.strength)
        if scales is not None:
            if self._written[layer]:
                slots = torch.unique(torch.cat(self._written[layer]))
                formats.store_prepared(formats.load_slots(pool, slots) * scales, pool, slots)
            pool.channel_scale = scales.contiguous()
        self.applied[layer] = scales is not None
        self.frozen[layer] = True
        self._written[layer].clear()
