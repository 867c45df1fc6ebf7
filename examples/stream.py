"""Stream the answer token by token as it is decoded, with sampling and a stop string.

    python examples/stream.py "Write a haiku about GPUs."
    python examples/stream.py --temperature 0.7 --seed 1 "Once upon a time"
"""

import argparse
import sys

import metrale_cli as metrale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="Name three colours of the rainbow.")
    parser.add_argument("-m", "--model", default=None, help="HF folder, .gguf file or hub id")
    parser.add_argument("-t", "--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    llm = metrale.load(args.model)
    params = metrale.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    seed=args.seed, stop=tuple(args.stop))
    for piece in llm.stream(args.prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    print(f"\n[decode: {llm.stats.decode_tokens} tokens at {llm.stats.decode_tps:.1f} tok/s]")


if __name__ == "__main__":
    main()
