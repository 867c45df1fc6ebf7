"""Several prompts decoded together as one batch, each with its own answer.

    python examples/batch.py
    python examples/batch.py -m ./Qwen3-8B "First question" "Second question" "Third question"
"""

import argparse

import metrale_cli as metrale

QUESTIONS = ["What is the capital of France?", "What is the capital of Italy?", "What is the capital of Spain?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="*", default=QUESTIONS)
    parser.add_argument("-m", "--model", default=None, help="HF folder, .gguf file or hub id")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    # max_num_seqs: how many sequences the KV pool and the decode graphs are sized for
    llm = metrale.load(args.model, max_num_seqs=len(args.prompts))
    for i, answer in enumerate(llm.generate(args.prompts, max_new_tokens=args.max_new_tokens), 1):
        print(f"[{i}] {answer.prompt}\n    {answer.text.strip()}  ({answer.finish_reason})")


if __name__ == "__main__":
    main()
