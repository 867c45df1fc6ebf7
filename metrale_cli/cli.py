"""The thin typer app: parse, call the library, render through output.py."""

from __future__ import annotations

import json
import logging
import sys
from typing import Annotated, Optional

import typer

from metrale_cli.environment import levers_help
from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import KvCacheDtype, parse_kv_cache_dtype, valid_names
from metrale_cli.output import Output

app = typer.Typer(
    name="metrale",
    help="Run large language models on NVIDIA GPUs (and their torch reference on the CPU).\n\n"
    + levers_help(),
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="HF folder, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")]
BackendOpt = Annotated[str, typer.Option(help="auto | cuda | torch (auto = cuda when a GPU is present)")]
RevisionOpt = Annotated[Optional[str], typer.Option(
    help="a hub id's branch, tag or commit (the same as -m owner/name@REVISION)")]


def _with_revision(model: str | None, revision: str | None) -> str | None:
    """-m and --revision as one spec, "owner/name@revision"."""
    from metrale_cli.checkpoint.hub import is_hub_id

    if revision is None:
        return model
    if model is None or not is_hub_id(model) or "@" in model:
        raise MetraleError(f"--revision applies to a hub id (-m owner/name), not {model or 'the default model'}",
                           hint="a local folder or .gguf file has no revisions")
    return f"{model}@{revision}"
ALL = "all"


def _kv_dtype(value: str | None) -> KvCacheDtype | str | None:
    return None if value is None else parse_kv_cache_dtype(value)


def _kv_or_all(value: str | None) -> KvCacheDtype | str | None:
    """validate-kernels' --kv-cache-dtype: a dtype, or ``all`` (every one of the 16)."""
    return ALL if value is not None and value.strip().lower() == ALL else _kv_dtype(value)


def _kv_dtypes(values: list[str] | None) -> list[KvCacheDtype | str] | None:
    return None if values is None else [parse_kv_cache_dtype(v) for v in values]


# --kv-cache-dtype is parsed once, here (the option's callback returns what the command gets): a
# KvCacheDtype, or "auto" for the model's config to resolve; a bad value is one error line listing
# the valid ones (KV_DTYPES.md).
KvOpt = Annotated[str, typer.Option(
    "--kv-cache-dtype", callback=_kv_dtype, metavar="DTYPE", help="KV-cache dtype: " + ", ".join(valid_names()))]
DtypeOpt = Annotated[str, typer.Option(
    help="weights/activations dtype: bf16 | fp16 | fp32 | auto (the checkpoint's bf16 or fp16, else bf16); "
    "also spelled bfloat16, float16, half, float32")]
MaxSeqOpt = Annotated[Optional[int], typer.Option(
    "--max-seq-len", "--max-model-len", help="context length of the KV pool (default: model's, at most 8192)")]
EagerOpt = Annotated[bool, typer.Option("--enforce-eager", help="vLLM's spelling of --cuda-graph-mode disabled")]
MODEL_DEFAULT = "; default: the model's recommended value (generation_config.json), else "
TempOpt = Annotated[Optional[float], typer.Option("--temperature", "-t", help="0 = greedy" + MODEL_DEFAULT + "0")]
TopKOpt = Annotated[Optional[int], typer.Option(help="0 = off" + MODEL_DEFAULT + "0")]
TopPOpt = Annotated[Optional[float], typer.Option(help="1 = off" + MODEL_DEFAULT + "1")]
RepOpt = Annotated[Optional[float], typer.Option(help="divide a seen token's positive logit (multiply a negative one) by "
                                                 "this; 1 = off" + MODEL_DEFAULT + "1")]
PresenceOpt = Annotated[float, typer.Option(help="subtract this from the logit of each token the answer has; "
                                            "0 = off")]
FrequencyOpt = Annotated[float, typer.Option(help="subtract this times the answer's count of a token from its "
                                             "logit; 0 = off")]
MinPOpt = Annotated[Optional[float], typer.Option(help="sample only tokens at least this fraction as likely as the "
                                                  "top one; 0 = off" + MODEL_DEFAULT + "0")]
GpuMemOpt = Annotated[float, typer.Option(help="fraction of GPU memory for weights + KV pool")]
CalibOpt = Annotated[Optional[int], typer.Option(
    "--fp8-kv-calibration-tokens", help="fp8 KV: calibrate scales over each layer's first write, at most N tokens "
    "(0 = off; default 256) when the checkpoint has none")]
GraphOpt = Annotated[str, typer.Option(
    "--cuda-graph-mode", help="full: replay each decode step as one CUDA graph (cuda backend); disabled: eager")]
HighPrecOpt = Annotated[str, typer.Option(
    "--kv-high-precision-layers", help="N | auto | max | all: boundary layers that keep bf16 KV (first "
    "ceil(N/2), last floor(N/2)); turbo and asymmetric dtypes promote a minimum even at 0")]
InnerQOpt = Annotated[Optional[int], typer.Option(
    "--innerq-calibration-tokens", help="InnerQ for a rotated (turbo) K side: calibrate per-channel "
    "scales over the first N tokens (0 = off; default: TURBO_INNERQ, else off)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="show tracebacks")]
TpOpt = Annotated[int, typer.Option("--tensor-parallel-size", "-tp", help="shard the model over this many GPUs "
                                    "(processes; gloo on the CPU), rank 0 writing the output")]
AllReduceOpt = Annotated[str, typer.Option(
    "--all-reduce", help="how tensor-parallel ranks sum a decode step's parts: nccl, or one-shot (one kernel "
    "that reads every rank's part over CUDA IPC; NCCL for what does not fit its buffers)")]


def _run(out: Output, debug: bool, fn, *args, **kwargs):
    """Run a library call; MetraleError, and running out of GPU or host memory, become one clear
    line and exit code 1."""
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s")
    try:
        return fn(*args, **kwargs)
    except MetraleError as e:
        if debug:
            raise
        out.error(e.message, e.hint)
        raise typer.Exit(1) from None
    except (MemoryError, RuntimeError) as e:
        message = _out_of_memory(e)
        if message is None or debug:
            raise
        out.error(message, "a smaller model or --dtype, a shorter --max-seq-len or smaller batch, "
                           "or --tensor-parallel-size N over more GPUs")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        out.error("interrupted")
        raise typer.Exit(130) from None


def _out_of_memory(e: BaseException) -> str | None:
    """The error line of an allocation that failed (torch's OutOfMemoryError on a GPU, Python's
    MemoryError on the host), else None."""
    if isinstance(e, MemoryError):
        return "out of host memory" + (f": {e}" if str(e) else "")
    if type(e).__name__ != "OutOfMemoryError":  # torch.OutOfMemoryError, not imported here
        return None
    first = str(e).split(". ")  # "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."
    return "out of GPU memory" + (f": {first[1].rstrip('.')}" if len(first) > 1 and first[1] else "")


def _read_text(out: Output, path: str | None, what: str) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        out.error(f"{what} not found: {path}", "check the path")
    except (OSError, UnicodeDecodeError) as e:
        out.error(f"cannot read the {what} {path}: {e}", "give a UTF-8 text file")
    raise typer.Exit(1)


def _template_kwargs(out: Output, text: str | None) -> dict | None:
    """--chat-template-kwargs: a JSON object of more variables for the chat template."""
    if text is None:
        return None
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        kwargs, why = None, f"is not JSON ({exc})"
    except RecursionError:  # json's parser recurses once per level of nesting
        kwargs, why = None, "is not JSON (nested too deeply)"
    else:
        why = "is not a JSON object"
    if not isinstance(kwargs, dict):
        out.error(f"--chat-template-kwargs {text!r} {why}", """e.g. --chat-template-kwargs '{"enable_thinking": false}'""")
        raise typer.Exit(1)
    return kwargs


def _check_system(out: Output, system: str | None) -> None:
    """An empty --system would fall back to the chat template's default system message, unsaid."""
    if system is not None and not system.strip():
        out.error("--system is empty", "give the system message's text, or leave --system out")
        raise typer.Exit(1)


SeedOpt = Annotated[Optional[int], typer.Option(
    help="reproducible sampling: an answer depends on the seed and its prompt alone (under generate --n, "
         "on which answer it is too)")]
ChatTemplateOpt = Annotated[Optional[str], typer.Option(
    "--chat-template", help="a Jinja chat template file, in place of the model's")]
TemplateKwargsOpt = Annotated[Optional[str], typer.Option(
    "--chat-template-kwargs", help="""more variables for the chat template, a JSON object: e.g. '{"enable_thinking": """
    """false}' (Qwen3 answers without thinking)""")]


def _set_sampling(**options) -> dict:
    """The sampling options the user set (the others take the model's recommended values)."""
    return {name: value for name, value in options.items() if value is not None}


@app.command()
def generate(
    prompt: Annotated[Optional[list[str]], typer.Argument(
        help="prompt(s); several are decoded as one batch; none or '-' reads stdin")] = None,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    backend: BackendOpt = "auto",
    kv_cache_dtype: KvOpt = "auto",
    dtype: DtypeOpt = "bf16",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 256,
    temperature: TempOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    repetition_penalty: RepOpt = None,
    presence_penalty: PresenceOpt = 0.0,
    frequency_penalty: FrequencyOpt = 0.0,
    samples: Annotated[int, typer.Option("--n", help="answers per prompt (sampled together)")] = 1,
    logprobs: Annotated[int, typer.Option(help="with --json: each token's log-probability and the N likeliest "
                                          "tokens' (0 = off)")] = 0,
    seed: SeedOpt = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,
    system: Annotated[Optional[str], typer.Option(help="system message for the chat template")] = None,
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="send the raw prompt")] = False,
    chat_template: ChatTemplateOpt = None,
    chat_template_kwargs: TemplateKwargsOpt = None,
    ignore_eos: bool = False,
    max_seq_len: MaxSeqOpt = None,
    gpu_memory_utilization: GpuMemOpt = 0.9,
    fp8_kv_calibration_tokens: CalibOpt = None,
    prefill_chunk: Annotated[int, typer.Option(help="tokens per prefill chunk")] = 512,
    cuda_graph_mode: GraphOpt = "full",
    enforce_eager: EagerOpt = False,
    kv_high_precision_layers: HighPrecOpt = "0",
    innerq_calibration_tokens: InnerQOpt = None,
    prompt_file: Annotated[Optional[str], typer.Option(
        "--file", "-f", help="read the prompt from this UTF-8 text file")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="print KV and load details")] = False,
    tensor_parallel_size: TpOpt = 1,
    all_reduce: AllReduceOpt = "nccl",
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
):
    """Generate text, streamed.

    Examples:
      metrale generate "What is the capital of France?"
      metrale generate -m Qwen/Qwen3-0.6B --kv-cache-dtype fp8 -n 64 "Explain paged attention."
      echo "Hello" | metrale generate --no-chat-template -t 0.7 --seed 1
    """
    from metrale_cli.engine.runner import RunnerOptions
    from metrale_cli.engine.sampler import SamplingParams
    from metrale_cli.commands.generate import generate_rank
    from metrale_cli.engine.ranks import run_ranks

    out = Output(json_mode=json_out)
    prompts = list(prompt or [])
    if prompt_file is not None:
        if prompts:
            out.error("give the prompt as an argument or with --file, not both", "drop one of the two")
            raise typer.Exit(1)
        prompts = [_read_text(out, prompt_file, "prompt file")]
    if not prompts or prompts == ["-"]:
        if sys.stdin is None or sys.stdin.isatty():
            out.error("no prompt given", "pass a prompt argument or pipe one on stdin; metrale chat holds a conversation")
            raise typer.Exit(1)
        prompts = [sys.stdin.read()]
    empty = [i + 1 for i, p in enumerate(prompts) if not p.strip()]
    if empty:
        out.error(f"prompt {empty[0]} is empty", "give the model some text to answer or continue")
        raise typer.Exit(1)
    if samples < 1:
        out.error(f"--n must be at least 1, got {samples}", "answers per prompt, e.g. --n 3")
        raise typer.Exit(1)
    prompts = [p for p in prompts for _ in range(samples)]
    template = _read_text(out, chat_template, "chat template file")
    template_kwargs = _template_kwargs(out, chat_template_kwargs)
    for flag, value in (("--chat-template", template), ("--chat-template-kwargs", template_kwargs)):
        if value is not None and no_chat_template:
            out.error(f"{flag} and --no-chat-template contradict each other", "drop one of the two")
            raise typer.Exit(1)
    _check_system(out, system)
    if system is not None and no_chat_template:
        out.error("--system needs the chat template, and --no-chat-template sends the raw prompt",
                  "drop one of the two (or write the system text into the prompt)")
        raise typer.Exit(1)
    opts = RunnerOptions(backend=backend, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                         max_seq_len=max_seq_len, max_num_seqs=len(prompts),
                         gpu_memory_utilization=gpu_memory_utilization,
                         fp8_kv_calibration_tokens=fp8_kv_calibration_tokens, prefill_chunk=prefill_chunk,
                         cuda_graph_mode="disabled" if enforce_eager else cuda_graph_mode,
                         kv_high_precision_layers=kv_high_precision_layers,
                         innerq_calibration_tokens=innerq_calibration_tokens, all_reduce=all_reduce)
    sampling = _set_sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repetition_penalty=repetition_penalty)
    params = SamplingParams(max_new_tokens=max_new_tokens, seed=seed, stop=tuple(stop or ()), ignore_eos=ignore_eos,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            logprobs=logprobs, **sampling)
    if logprobs and not json_out:
        out.error(f"--logprobs {logprobs} is shown in the --json output only", "add --json")
        raise typer.Exit(1)
    _run(out, debug, lambda: run_ranks(
        tensor_parallel_size, generate_rank, _with_revision(model, revision), opts, prompts, params,
        chat=not no_chat_template, system=system, verbose=verbose, chat_template=template,
        explicit=frozenset(sampling), template_kwargs=template_kwargs, main_output=out,
        on_worker_error=out.error))


@app.command()
def chat(
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    backend: BackendOpt = "auto",
    kv_cache_dtype: KvOpt = "auto",
    dtype: DtypeOpt = "bf16",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="at most this many tokens an "
                                                "answer")] = 512,
    temperature: TempOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    repetition_penalty: RepOpt = None,
    presence_penalty: PresenceOpt = 0.0,
    frequency_penalty: FrequencyOpt = 0.0,
    seed: SeedOpt = None,
    system: Annotated[Optional[str], typer.Option(help="system message")] = None,
    chat_template: ChatTemplateOpt = None,
    chat_template_kwargs: TemplateKwargsOpt = None,
    max_seq_len: MaxSeqOpt = None,
    gpu_memory_utilization: GpuMemOpt = 0.9,
    cuda_graph_mode: GraphOpt = "full",
    enforce_eager: EagerOpt = False,
    tensor_parallel_size: Annotated[int, typer.Option(
        "--tensor-parallel-size", "-tp", help="1 only: a chat runs in one process (generate and bench "
        "take -tp N)")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="one JSON object a turn (JSON Lines)")] = False,
    debug: DebugOpt = False,
):
    """A conversation with a model, streamed.

    Each message goes through the chat template with the turns before it. On a terminal: type at the > prompt; /reset forgets the conversation, /system TEXT sets the
    system message, /help lists the commands, /exit or Ctrl-D ends; Ctrl-C stops an answer, not
    the session. With stdin not a terminal every non-empty line is one turn (for scripts).

    Examples:
      metrale chat
      metrale chat -m ./Qwen3-8B --system "Answer in one sentence."
      printf 'Hi!\nWhat did I just say?\n' | metrale chat --json
    """
    from metrale_cli.commands.chat import run_chat
    from metrale_cli.engine.runner import RunnerOptions
    from metrale_cli.engine.sampler import SamplingParams

    out = Output(json_mode=json_out)
    if tensor_parallel_size != 1:  # declared so that -tp is not read as -t p
        out.error(f"metrale chat runs in one process, not --tensor-parallel-size {tensor_parallel_size}",
                  "drop -tp, or use metrale generate -tp N for one prompt")
        raise typer.Exit(1)
    _check_system(out, system)
    opts = RunnerOptions(backend=backend, kv_cache_dtype=kv_cache_dtype, dtype=dtype, max_seq_len=max_seq_len,
                         gpu_memory_utilization=gpu_memory_utilization,
                         cuda_graph_mode="disabled" if enforce_eager else cuda_graph_mode)
    sampling = _set_sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repetition_penalty=repetition_penalty)
    code = _run(out, debug, lambda: run_chat(out, _with_revision(model, revision), opts, SamplingParams(
        max_new_tokens=max_new_tokens, seed=seed, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, **sampling), system, chat_template=_read_text(out, chat_template,
                                                                                           "chat template file"),
        explicit=frozenset(sampling), template_kwargs=_template_kwargs(out, chat_template_kwargs)))
    raise typer.Exit(code)


@app.command("validate-kernels")
def validate_kernels(
    kv_cache_dtype: Annotated[str, typer.Option(
        "--kv-cache-dtype", callback=_kv_or_all, metavar="DTYPE",
        help="one of: " + ", ".join(valid_names()) + "; or all (every dtype)")],
    head_dim: Annotated[int, typer.Option(help="attention head_dim the kernels must serve")] = 128,
    recheck: Annotated[bool, typer.Option(
        "--recheck", help="run every numeric check again, even those this GPU passed for the same sources")] = False,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
):
    """Check that every kernel a KV-cache dtype needs is present and compiles (and, on a GPU, is right).

    Without a GPU each kernel is compiled to an sm_90 cubin and its exported symbol checked; on a
    GPU each is loaded through CuPy and compared with its torch reference on small odd shapes. A
    passed comparison is remembered in the kernel cache for this GPU and these sources: later runs
    say "matches reference (cached)" and skip it (--recheck runs it again).
    Exits 1 with the whole list of what is missing.

    Examples:
      metrale validate-kernels --kv-cache-dtype fp8
      metrale validate-kernels --kv-cache-dtype turbo3 --head-dim 256 --json
      metrale validate-kernels --kv-cache-dtype all --recheck
    """
    from metrale_cli.commands.validate import run_validate

    out = Output(json_mode=json_out)
    _run(out, debug, run_validate, out, kv_cache_dtype, head_dim, recheck)


@app.command()
def bench(
    ctx: typer.Context,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    preset: Annotated[Optional[str], typer.Option(help="random weights at a real model's shapes "
                                                   "(qwen3-0.6b, qwen3-8b, qwen3-30b-a3b, qwen3.5-27b, "
                                                   "smollm2, ...)")] = None,
    n_prompt: Annotated[str, typer.Option(
        "--n-prompt", "-p", help="prompt tokens (pp test); a comma list sweeps, e.g. 128,512")] = "512",
    n_gen: Annotated[str, typer.Option(
        "--n-gen", "-n", help="generated tokens (tg test); a comma list sweeps")] = "128",
    batch: Annotated[str, typer.Option(help="sequences decoded together; a comma list sweeps")] = "1",
    output: Annotated[str, typer.Option(
        "--output", "-o", help="table | md | csv | json | jsonl (llama-bench's formats; --json = json)")] = "table",
    repetitions: Annotated[int, typer.Option("--repetitions", "-r")] = 3,
    kv_cache_dtype: Annotated[Optional[list[str]], typer.Option(
        "--kv-cache-dtype", callback=_kv_dtypes, metavar="DTYPE",
        help="repeatable: one row set per dtype (" + ", ".join(valid_names()) + ")")] = None,
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "bf16",
    peak_bandwidth: Annotated[Optional[float], typer.Option(
        help="roofline bandwidth in GB/s (default: measured device-to-device copy)")] = None,
    compare_hf: Annotated[bool, typer.Option("--compare-hf", help="also time HF transformers on the same weights")] = False,
    gpu_memory_utilization: Annotated[float, typer.Option(
        help="the KV tokens column: the pool generate would build at this fraction of GPU memory")] = 0.9,
    cuda_graph_mode: GraphOpt = "full",
    enforce_eager: EagerOpt = False,
    profile: Annotated[bool, typer.Option(
        "--profile", help="print the top kernels by time (torch profiler) and, on a GPU, the decode step's critical path"
    )] = False,
    synthetic_context: Annotated[bool, typer.Option(
        "--synthetic-context", help="fill the -p context with random K/V through the cache-write kernels "
        "instead of prefilling it: decode timing at long contexts (no pp row)")] = False,
    kv_high_precision_layers: HighPrecOpt = "0",
    innerq_calibration_tokens: InnerQOpt = None,
    kv_quality: Annotated[bool, typer.Option(
        "--kv-quality", help="instead of timing: KL divergence, perplexity change and top-1 agreement "
        "of each KV dtype against bf16 KV on a text corpus (default: all 16 dtypes)")] = False,
    corpus: Annotated[Optional[str], typer.Option(help="--kv-quality: a UTF-8 text file (default: the "
                                                  "shipped English corpus)")] = None,
    window: Annotated[int, typer.Option(help="--kv-quality: tokens per scored window")] = 512,
    tensor_parallel_size: TpOpt = 1,
    all_reduce: AllReduceOpt = "nccl",
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
):
    """Time prefill (ppN) and decode (tgN) against the bandwidth roofline, or measure KV quality.

    Reports tokens/s, achieved GB/s, % of the roofline, KV bytes per token and pool capacity.
    With --kv-quality: how much each KV dtype changes the next-token distributions against
    bf16 KV (KL divergence, perplexity change, top-1 agreement).

    Examples:
      metrale bench --preset qwen3-8b --compare-hf
      metrale bench --preset qwen3-30b-a3b -p 512 -n 128
      metrale bench --preset qwen3.5-27b -p 4096 -n 8 --compare-hf
      metrale bench --preset qwen3-0.6b -p 512 -n 128 --batch 16 --kv-cache-dtype bf16 --kv-cache-dtype fp8
      metrale bench -m ./my-model --json
      metrale bench --preset smollm2 -p 128,512 -n 32 -o md
      metrale bench --kv-quality --backend torch
    """
    out = Output(json_mode=json_out)
    model = _run(out, debug, _with_revision, model, revision)
    if kv_quality:
        _refuse_unread(out, ctx, _TIMING_ONLY, "--kv-quality measures quality, not time",
                       "--kv-quality reads -m, --corpus, --window, --kv-cache-dtype, --backend, --dtype, "
                       "--kv-high-precision-layers, --innerq-calibration-tokens and --json")
    else:
        _refuse_unread(out, ctx, ("corpus", "window"), "bench times the model without --kv-quality",
                       "add --kv-quality to measure KV quality on a corpus")
    if kv_quality:
        from metrale_cli.commands.kv_quality import QualityOptions, run_quality_cmd

        qopts = QualityOptions(model=model, corpus=corpus, window=window,
                               kv_cache_dtypes=tuple(kv_cache_dtype or ()), backend=backend, dtype=dtype,
                               kv_high_precision_layers=kv_high_precision_layers,
                               innerq_calibration_tokens=innerq_calibration_tokens)
        _run(out, debug, run_quality_cmd, out, qopts)
        return
    from metrale_cli.commands.bench import BenchOptions, bench_rank
    from metrale_cli.engine.ranks import run_ranks

    sweep = _run(out, debug, _sweep, n_prompt, n_gen, batch)
    opts = BenchOptions(model=model, preset=preset, n_prompt=sweep[0][0], n_gen=sweep[0][1], batch=sweep[0][2],
                        repetitions=repetitions, kv_cache_dtypes=tuple(kv_cache_dtype or ("auto",)),
                        backend=backend, dtype=dtype, peak_bandwidth_gbs=peak_bandwidth,
                        compare_hf=compare_hf, gpu_memory_utilization=gpu_memory_utilization,
                        cuda_graph_mode="disabled" if enforce_eager else cuda_graph_mode, all_reduce=all_reduce,
                        profile=profile, synthetic_context=synthetic_context,
                        kv_high_precision_layers=kv_high_precision_layers,
                        innerq_calibration_tokens=innerq_calibration_tokens)
    _run(out, debug, run_ranks, tensor_parallel_size, bench_rank, opts, sweep, output.strip().lower(),
         main_output=out, on_worker_error=out.error)


# bench's options that only its timing reads, not --kv-quality
_TIMING_ONLY = ("preset", "n_prompt", "n_gen", "batch", "output", "repetitions", "peak_bandwidth", "compare_hf",
                "gpu_memory_utilization", "cuda_graph_mode", "enforce_eager", "profile", "synthetic_context",
                "tensor_parallel_size", "all_reduce")


def _refuse_unread(out: Output, ctx: typer.Context, names: tuple[str, ...], why: str, hint: str) -> None:
    """Options given that this run would not read are one error line, never silently ignored."""
    given = [p.opts[0] for p in ctx.command.params
             if p.name in names and ctx.get_parameter_source(p.name).name != "DEFAULT"]
    if given:
        out.error(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply here: {why}", hint)
        raise typer.Exit(1)


_COUNT_EXAMPLES = {"-p": "128,512", "-n": "32,128", "--batch": "1,16"}


def _counts(flag: str, value: str) -> list[int]:
    """A comma list of positive counts (bench's sweeps)."""
    hint = f"e.g. {flag} {_COUNT_EXAMPLES[flag]}"
    try:
        counts = [int(v) for v in value.split(",")]
    except ValueError:
        raise MetraleError(f"{flag} takes a count or a comma list of counts, not '{value}'", hint=hint) from None
    if min(counts) < 1:
        raise MetraleError(f"{flag} counts must all be at least 1, got '{value}'", hint=hint)
    return counts


def _sweep(n_prompt: str, n_gen: str, batch: str) -> list[tuple[int, int, int]]:
    """Every (-p, -n, --batch) combination, -p slowest."""
    return [(p, n, b) for p in _counts("-p", n_prompt) for n in _counts("-n", n_gen) for b in _counts("--batch", batch)]


def _version(value: bool) -> None:
    if value:
        from metrale_cli.environment import VERSION

        print(f"metrale {VERSION}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="print the version and exit")] = False) -> None:
    """Run large language models on NVIDIA GPUs (and their torch reference on the CPU)."""


def _click_exceptions():
    """The exceptions typer's parser raises: its own copy of click's (typer 0.2x vendors click),
    else click's."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


def main() -> None:
    """The console entry point: typer parses, every failure is one error line and exit code 1
    (usage errors included: an unknown option, a value that is not a number)."""
    click = _click_exceptions()
    out = Output(json_mode="--json" in sys.argv[1:])
    # stdin's bytes that are not UTF-8 reach the prompt's check as argv's do, not a UnicodeDecodeError
    # where the locale decodes strictly
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    try:
        code = app(standalone_mode=False)
    except MetraleError as e:  # raised while typer parses (option callbacks)
        out.error(e.message, e.hint)
        sys.exit(1)
    except click.UsageError as e:
        command = e.ctx.command_path if e.ctx is not None else "metrale"
        out.error(e.format_message(), f"see '{command} --help'")
        sys.exit(1)
    except click.ClickException as e:
        out.error(e.format_message())
        sys.exit(1)
    except (typer.Abort, KeyboardInterrupt):
        out.error("interrupted")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
