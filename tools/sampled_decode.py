"""Decode speed of `generate` greedy against sampled, on a bench preset's random weights (figures, no asserts).

    python -m tools.sampled_decode --preset qwen3-0.6b --preset qwen3-8b

Greedy decode takes its tokens on the device inside the step's graph; a sampled step runs the
sampler's torch ops after the graph (penalties, temperature, top-k, a full-vocabulary sort for
top-p, the draw; with a seed one draw launch a sequence). This prints the engine's decode tok/s
for each setting at batch 1 and 16, twice each after a warm-up, so what sampling costs beside the
step is measured, not guessed.
"""

from __future__ import annotations

import argparse

CASES = {
    "greedy": {},
    "t0.7": dict(temperature=0.7),
    "t0.7 top_p 0.95": dict(temperature=0.7, top_p=0.95),
    "t0.7 top_k 20 top_p 0.95": dict(temperature=0.7, top_k=20, top_p=0.95),
    "the same, seeded": dict(temperature=0.7, top_k=20, top_p=0.95, seed=1),
}


def main() -> None:
    import torch

    from metrale_cli.commands.bench_presets import PRESETS, random_weights
    from metrale_cli.engine.runner import RunnerOptions, open_runner
    from metrale_cli.engine.sampler import SamplingParams
    from metrale_cli.engine.source import ModelSource

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", required=True, choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("-n", type=int, default=256, help="new tokens a sequence")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for preset in args.preset:
        raw = PRESETS[preset]
        weights = random_weights(raw, device, torch.bfloat16)
        runner = open_runner(RunnerOptions(backend="auto", max_seq_len=args.prompt + args.n + 16,
                                           max_num_seqs=max(args.batch), reserve_all_memory=False),
                             ModelSource.loaded(raw, weights, None, preset))
        prompt = torch.randint(0, raw["vocab_size"], (args.prompt,), generator=torch.Generator().manual_seed(0))
        for batch in args.batch:
            for name, sampling in CASES.items():
                params = SamplingParams(max_new_tokens=args.n, ignore_eos=True, **sampling)
                runner.engine.generate([prompt.tolist()] * batch, params)  # warm-up: graphs, allocator
                rates = [runner.engine.generate([prompt.tolist()] * batch, params)[1].decode_tps for _ in range(2)]
                print(f"{preset} {runner.backend} batch {batch:3d} {name:26s} decode "
                      f"{min(rates):9.1f} - {max(rates):9.1f} tok/s", flush=True)
        del runner, weights
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
