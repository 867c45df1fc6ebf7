"""How much each KV-cache dtype changes a model's predictions on your own text.

    python examples/kv_quality.py my_notes.txt
    python examples/kv_quality.py my_notes.txt -m ./Qwen3-8B --kv-cache-dtype fp8 --kv-cache-dtype turbo4

The text is cut into windows and run teacher-forced, once with bf16 KV and once per dtype: the mean
KL divergence of the next-token distributions, the change in perplexity and how often the top
token agrees, as deployed (bf16 boundary layers kept) and with the dtype on every layer.
"""

import argparse

import metrale_cli as metrale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", help="a UTF-8 text file")
    parser.add_argument("-m", "--model", default=None, help="HF folder, .gguf file or hub id")
    parser.add_argument("--kv-cache-dtype", action="append", default=None,
                        help="repeatable (default: fp8, nvfp4, turbo4)")
    parser.add_argument("--window", type=int, default=256, help="tokens per scored window")
    args = parser.parse_args()

    dtypes = tuple(args.kv_cache_dtype or ("fp8", "nvfp4", "turbo4"))
    result = metrale.kv_quality(model=args.model, corpus=args.text, window=args.window, kv_cache_dtypes=dtypes)
    print(f"{result['tokens']} tokens in {result['windows']} windows; bf16 KV perplexity {result['reference_ppl']:.3f}")
    print(f"{'dtype':<16}{'B/token':>8}{'mean KL':>9}{'ΔPPL':>9}{'top-1':>8}{'KL, every layer':>17}{'top-1':>8}")
    for row in result["rows"]:
        every = row["all_layers"]
        print(f"{row['kv_cache_dtype']:<16}{row['kv_bytes_per_token']:>8}{row['mean_kl']:>9.4f}"
              f"{row['ppl_delta_pct']:>+8.2f}%{100 * row['top1_agreement']:>7.1f}%"
              f"{every['mean_kl']:>17.4f}{100 * every['top1_agreement']:>7.1f}%")


if __name__ == "__main__":
    main()
