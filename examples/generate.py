"""Generate from Python: load a model and ask it a question.

    python examples/generate.py                                  # the embedded SmolLM2-135M-Instruct
    python examples/generate.py -m ./Qwen3-8B --kv-cache-dtype fp8 "Explain paged attention."
"""

import argparse

import metrale_cli as metrale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("-m", "--model", default=None, help="HF folder, .gguf file or hub id")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    llm = metrale.load(args.model, kv_cache_dtype=args.kv_cache_dtype)
    answer = llm.generate(args.prompt, max_new_tokens=args.max_new_tokens)
    print(answer.text)
    print(f"[{len(answer.token_ids)} tokens, finish: {answer.finish_reason}, "
          f"{llm.stats.decode_tps:.1f} tok/s decode]")


if __name__ == "__main__":
    main()
