"""metrale's Python API: load a model, generate (batched or streamed), check kernels, bench, KV quality.

    import metrale_cli as metrale

    llm = metrale.load()                                  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("What is the capital of France?", max_new_tokens=32).text)
    for piece in llm.stream("Tell me a story.", max_new_tokens=64):
        print(piece, end="", flush=True)

Every failure a user can cause is a :class:`~metrale_cli.errors.MetraleError` with a message and a
hint, as the command line prints them.
"""

from __future__ import annotations

from metrale_cli.commands.bench import BenchOptions, run_bench
from metrale_cli.commands.kv_quality import QualityOptions, run_quality
from metrale_cli.engine.llm import LLM, Completion, render_prompt  # noqa: F401 - the API's names
from metrale_cli.engine.runner import RunnerOptions, open_runner
from metrale_cli.engine.source import ModelSource
from metrale_cli.kernels.validate import ValidationReport
from metrale_cli.kernels.validate import validate_kernels as _validate


def load(model: str | None = None, options: RunnerOptions | None = None, **settings) -> LLM:
    """Load ``model`` (an HF folder, a ``.gguf`` file, a hub id, or None for the embedded
    SmolLM2-135M-Instruct) after the start-up kernel check. ``settings``: :class:`RunnerOptions`
    fields (``backend``, ``kv_cache_dtype``, ``max_seq_len``, ``max_num_seqs``, ...)."""
    return LLM(open_runner(options or RunnerOptions(**settings), ModelSource.checkpoint(model)))


def validate_kernels(kv_cache_dtype, head_dim: int = 128, recheck: bool = False) -> ValidationReport:
    """The start-up kernel check of one KV dtype alone -> a ``ValidationReport`` (``.ok``, ``.rows``:
    each kernel's compile, symbol and numeric verdict). Without a GPU the kernels are compiled
    for sm_90; on a GPU each is run against its torch reference."""
    return _validate(kv_cache_dtype, head_dim, recheck=recheck)


def bench(**settings) -> dict:
    """``metrale bench`` as a call: ``settings`` are ``BenchOptions`` fields (``preset``, ``model``,
    ``n_prompt``, ``n_gen``, ``batch``, ``kv_cache_dtypes``, ...) -> the rows it prints."""
    return run_bench(BenchOptions(**settings))


def kv_quality(**settings) -> dict:
    """``metrale bench --kv-quality`` as a call: ``settings`` are ``QualityOptions`` fields
    (``model``, ``corpus`` (a text file), ``window``, ``kv_cache_dtypes``, ...) -> its rows."""
    return run_quality(QualityOptions(**settings))
