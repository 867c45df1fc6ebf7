"""Time prefill and decode on random weights at a real model's shapes, against the bandwidth roofline.

    python examples/bench_preset.py                       # SmolLM2-135M's shape, short runs (CPU is fine)
    python examples/bench_preset.py --preset qwen3-8b -p 512 -n 128 --kv-cache-dtype bf16 --kv-cache-dtype fp8

On a GPU each decode row says the bandwidth it reached and its share of the roofline (the bytes a
step reads over the measured copy bandwidth).
"""

import argparse

import metrale_cli as metrale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2")
    parser.add_argument("-p", "--n-prompt", type=int, default=32)
    parser.add_argument("-n", "--n-gen", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", action="append", default=None)
    parser.add_argument("-r", "--repetitions", type=int, default=2)
    args = parser.parse_args()

    result = metrale.bench(preset=args.preset, n_prompt=args.n_prompt, n_gen=args.n_gen, batch=args.batch,
                           repetitions=args.repetitions, kv_cache_dtypes=tuple(args.kv_cache_dtype or ("auto",)))
    print(f"{result['model']} on {result['device']}")
    for row in result["rows"]:
        roofline = f"{row['roofline_pct']:.1f}% of roofline" if "roofline_pct" in row else ""
        print(f"{row['engine']:<36}{row['test']:<22}{row['tokens_per_s']:>10.1f} t/s  {roofline}")


if __name__ == "__main__":
    main()
