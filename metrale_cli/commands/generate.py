"""The generate command: load, apply the chat template, stream, report speed."""

from __future__ import annotations

from metrale_cli.engine.llm import LLM, render_prompt, set_template
from metrale_cli.engine.generate import check_prompt_lengths
from metrale_cli.engine.runner import RunnerOptions, open_runner
from metrale_cli.engine.sampler import SamplingParams, with_model_defaults
from metrale_cli.engine.source import ModelSource
from metrale_cli.output import Output, SilentOutput
from metrale_cli.layers.parallel import SINGLE, TensorParallel


def generate_rank(tp: TensorParallel, device, out: Output | None, *args, **kwargs) -> list[dict]:
    """:func:`run_generate` as one tensor-parallel rank runs it (``engine.ranks.run_ranks``): rank 0
    with the command's output, the others with none."""
    return run_generate(out or SilentOutput(), *args, tp=tp, **kwargs)


def run_generate(out: Output, model: str | None, opts: RunnerOptions, prompts: list[str], params: SamplingParams,
                 chat: bool = True, system: str | None = None, verbose: bool = False,
                 chat_template: str | None = None, tp: TensorParallel = SINGLE,
                 explicit: frozenset[str] | None = None, template_kwargs: dict | None = None) -> list[dict]:
    """``chat_template``: Jinja text in place of the checkpoint's template, ``template_kwargs`` more
    variables for it (``{"enable_thinking": False}``); ``tp``: this process's
    tensor-parallel rank (every rank runs the same generation; rank 0 writes it); ``explicit``:
    the sampling fields the user set, the others taking the checkpoint's recommended values (None:
    ``params`` as given)."""
    source, ids = ModelSource.checkpoint(model), []
    params, sampling = (params, None) if explicit is None else \
        with_model_defaults(params, explicit, source.sampling())

    def check_prompts(tokenizer, context: int, vocab_size: int) -> None:  # before the weights: fail fast
        set_template(tokenizer, chat_template, template_kwargs)
        ids.extend(render_prompt(tokenizer, p, chat, system) for p in prompts)
        check_prompt_lengths(ids, context, vocab_size)

    with out.progress("loading weights") as progress:
        llm = LLM(open_runner(opts, source, progress, before_weights=check_prompts, tp=tp))
    runner = llm.runner
    unread = set_template(llm.tokenizer, chat_template, template_kwargs) if chat else None
    out.info(f"model: {runner.source} · backend {runner.backend} · kv {runner.kv_dtype.value}")
    for line in runner.messages if verbose else runner.messages[1:]:
        out.info(line)
    if sampling:
        out.info(sampling)
    if chat and not llm.tokenizer.has_chat_template:
        out.info("the model has no chat template: sending the raw prompt")
    elif unread:
        out.info(unread)
    single = len(prompts) == 1 and not out.json_mode
    on_text = (lambda _i, delta: out.stream(delta)) if single else None
    done = llm.complete(prompts, ids, params, on_text)
    stats = llm.stats
    results = [{"prompt": c.prompt, "text": c.text, "finish_reason": c.finish_reason,
                "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids), "token_ids": c.token_ids}
               | ({"logprobs": c.logprobs} if c.logprobs else {}) for c in done]
    if out.json_mode:
        out.json({"results": results, "prompt_tokens_per_s": stats.prompt_tps, "decode_tokens": stats.decode_tokens,
                  "decode_tokens_per_s": stats.decode_tps if stats.decode_tokens else None,  # no decode step ran
                  "graph_capture_seconds": stats.capture_seconds})
        return results
    if single:
        out.stream("\n")
    else:
        for i, r in enumerate(results):
            out.text(f"--- [{i + 1}] {r['text']}")
    completion = sum(r["completion_tokens"] for r in results)
    capture = f"; CUDA graph capture {stats.capture_seconds:.2f} s, not counted" if stats.capture_seconds else ""
    speed = f" at {stats.decode_tps:.1f} tok/s" if stats.decode_tokens else ""  # no decode step ran: none measured
    out.info(f"prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.1f} tok/s · completion: {completion} "
             f"tokens ({completion - stats.decode_tokens} from the prefill, {stats.decode_tokens} decoded"
             f"{speed}{capture}) · finish: "
             + ", ".join(sorted({r['finish_reason'] for r in results})))
    innerq = runner.model.calibration.innerq.outcome()
    if innerq:
        out.info(innerq)
    return results
