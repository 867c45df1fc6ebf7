"""Where the host's time goes in a prefill: microseconds Python spends issuing each phase, per layer.

    python tools/prefill_host_timing.py --preset qwen3-8b -p 4096        # on a GPU
    python tools/prefill_host_timing.py --preset smollm2 -p 64 --backend torch

Builds a preset model on random weights, wraps every layer's paged attention and FFN in timers
from the outside (the layers know nothing of it) and times prefills of ``-p`` tokens. Phases, summed
over the layers and averaged over the prefills: ``qk-norm, RoPE and cache write`` (the fused write,
or the unfused ops before calibration freezes), ``attention call`` (paged prefill: SDPA or the
kernel), ``ffn`` and the rest of the layer (``norms and projections``). Host time, not GPU time: where
it approaches the GPU's, launches are the bottleneck.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from metrale_cli.commands.bench_presets import PRESETS, random_weights
from metrale_cli.engine.runner import DTYPES, RunnerOptions, open_runner
from metrale_cli.engine.sequence import Sequence
from metrale_cli.engine.source import ModelSource

PHASES = {"rope_and_cache": "qk-norm, RoPE and cache write", "reshape_and_cache": "qk-norm, RoPE and cache write",
          "paged_prefill": "attention call", "ffn": "ffn"}


class Timed:
    """``target`` with the calls named in ``phases`` timed into ``totals`` (microseconds)."""

    def __init__(self, target, phases: dict[str, str], totals: dict[str, float]):
        self._target, self._phases, self._totals = target, phases, totals

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if name not in self._phases or not callable(value):
            return value
        return self._timed(value, self._phases[name])

    def _timed(self, fn, phase):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._totals[phase] += (time.perf_counter() - start) * 1e6
        return call

    def __call__(self, *args, **kwargs):
        return self._timed(self._target, self._phases["__call__"])(*args, **kwargs)


def instrument(model) -> dict[str, float]:
    """Wrap every layer's attention, FFN and prefill; returns the totals they add to."""
    totals: dict[str, float] = defaultdict(float)
    for layer in model.layers:
        layer.attention = Timed(layer.attention, PHASES, totals)
        layer.ffn = Timed(layer.ffn, {"__call__": "ffn", "add_row": "ffn"}, totals)
        layer.prefill = Timed(layer.prefill, {"__call__": "layer"}, totals)
    return totals


def per_prefill(totals: dict[str, float], prefills: int) -> dict[str, float]:
    """Each phase's microseconds per prefill, the layer's remainder as ``norms and projections``."""
    phases = {p: totals[p] / prefills for p in dict.fromkeys(PHASES.values())}
    phases["norms and projections"] = totals["layer"] / prefills - sum(phases.values())
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("-p", "--n-prompt", type=int, default=512)
    parser.add_argument("-r", "--repetitions", type=int, default=3)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--kv-cache-dtype", default="bf16")
    args = parser.parse_args()

    opts = RunnerOptions(backend=args.backend, kv_cache_dtype=args.kv_cache_dtype, max_seq_len=args.n_prompt + 1,
                         prefill_chunk=args.n_prompt, reserve_all_memory=False)
    device = torch.device("cuda" if torch.cuda.is_available() and args.backend != "torch" else "cpu")
    raw = PRESETS[args.preset]
    runner = open_runner(opts, ModelSource.loaded(raw, random_weights(raw, device, DTYPES[opts.dtype])))
    prompt = torch.randint(0, raw["vocab_size"], (args.n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.engine.teacher_forced(prompt)  # warm-up: kernel loads, allocator, calibration
    totals = instrument(runner.model)
    for _ in range(args.repetitions):
        seq = Sequence(0, list(prompt), 1)
        runner.engine.prefill(seq)
        runner.engine.release(seq)
    phases = per_prefill(totals, args.repetitions)
    print(f"{args.preset}, {args.n_prompt}-token prefill on {runner.backend}, host µs per prefill over "
          f"{len(runner.model.layers)} layers:")
    for phase, us in phases.items():
        print(f"  {phase:<32} {us:10.0f}")


if __name__ == "__main__":
    main()
