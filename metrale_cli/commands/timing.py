"""How bench times a region and reports a row: CUDA events on a GPU, the roofline's bandwidth."""

from __future__ import annotations

import statistics
import time

import torch


class Timer:
    """Wall time of a region: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def measure_copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), or None on the CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    with Timer(device) as t:
        for _ in range(10):
            dst.copy_(src)
    return 2 * src.numel() * 10 / t.seconds / 1e9


def timing_row(name: str, test: str, samples: list[float], tokens: int, step_bytes: float | None,
         peak: float | None) -> dict:
    tps = [tokens / s for s in samples]
    row = {"engine": name, "test": test, "tokens_per_s": statistics.mean(tps),
           "std": statistics.stdev(tps) if len(tps) > 1 else 0.0}
    if step_bytes is not None:  # at the row's rate (the mean of the samples' rates), as its t/s
        steps_per_s = statistics.mean(1 / s for s in samples)
        gbs = step_bytes * steps_per_s / 1e9 * (tokens if test.startswith("pp") else 1)
        row["achieved_gbs"] = gbs
        if peak:
            row["roofline_pct"] = 100 * gbs / peak
    return row
