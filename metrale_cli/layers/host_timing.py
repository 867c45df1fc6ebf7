"""Host-side phase timing of prefill (the ``METRALE_PREFILL_HOST_TIMING=1`` lever).

Microseconds the host spends issuing each phase of the prefill attention layers, summed over
layers and prefills: where Python, not the GPU, is the cost. Decode is not timed (it replays a
CUDA graph). With the lever off the layers get no timer and pay nothing.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

PHASES = ("projections", "to attention call", "attention call", "ffn")


@dataclass
class HostTiming:
    us: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    prefills: int = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.us[name] += (time.perf_counter() - start) * 1e6

    def per_prefill(self) -> dict[str, float]:
        return {k: v / max(self.prefills, 1) for k, v in self.us.items()}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.0f} µs" for k, v in self.per_prefill().items())
        return f"prefill host time per prefill, all layers ({self.prefills} prefills): {parts}"


def phase(timing: HostTiming | None, name: str):
    """The timer's phase, or a no-op when timing is off."""
    return timing.phase(name) if timing is not None else contextlib.nullcontext()
