"""The generate command: load, apply the chat template, stream, report speed."""

from __future__ import annotations

from metrale_cli.engine.generate import check_prompt_lengths
from metrale_cli.engine.runner import RunnerOptions, load_runner
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.output import Output


def render_prompt(tokenizer, text: str, chat: bool, system: str | None) -> list[int]:
    if chat and tokenizer.has_chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=True)


def run_generate(out: Output, opts: RunnerOptions, prompts: list[str], params: SamplingParams,
                 chat: bool = True, system: str | None = None, verbose: bool = False) -> list[dict]:
    ids: list[list[int]] = []

    def check_prompts(tokenizer, context: int) -> None:  # before the weights: fail fast
        ids.extend(render_prompt(tokenizer, p, chat, system) for p in prompts)
        check_prompt_lengths(ids, context)

    with out.progress("loading weights") as progress:
        runner = load_runner(opts, progress, before_weights=check_prompts)
    out.info(f"model: {runner.source} · backend {runner.backend} · kv {runner.kv_dtype.value}")
    if verbose:
        for line in runner.messages:
            out.info(line)
    else:
        for line in runner.messages[1:]:
            out.info(line)
    tok = runner.tokenizer
    if chat and not tok.has_chat_template:
        out.info("the model has no chat template: sending the raw prompt")
    single = len(prompts) == 1 and not out.json_mode
    on_text = (lambda _i, delta: out.stream(delta)) if single else None
    eos = set(tok.eos_token_ids) | set(runner.config.eos_token_ids)
    seqs, stats = runner.engine.generate(ids, params, eos_ids=eos, tokenizer=tok, on_text=on_text)
    results = [{"prompt": p, "text": s.text.text, "finish_reason": s.finish_reason,
                "prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.output_ids),
                "token_ids": s.output_ids}
               for p, s in zip(prompts, seqs)]
    if out.json_mode:
        out.json({"results": results, "prompt_tokens_per_s": stats.prompt_tps,
                  "decode_tokens_per_s": stats.decode_tps})
        return results
    if single:
        out.stream("\n")
    else:
        for i, r in enumerate(results):
            out.text(f"--- [{i + 1}] {r['text']}")
    out.info(f"prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.1f} tok/s · decode: "
             f"{stats.decode_tokens} tokens, {stats.decode_tps:.1f} tok/s · finish: "
             + ", ".join(sorted({r['finish_reason'] for r in results})))
    innerq = runner.model.innerq.outcome() if runner.model.innerq is not None else None
    if innerq:
        out.info(innerq)
    return results
