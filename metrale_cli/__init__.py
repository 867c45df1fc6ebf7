"""metrale: a command-line runner for large language models on NVIDIA GPUs, and its Python API.

    import metrale_cli as metrale
    llm = metrale.load()                       # or load("./Qwen3-8B", kv_cache_dtype="fp8")
    print(llm.generate("What is the capital of France?").text)

The API (``metrale_cli/api.py``): :func:`load` -> :class:`LLM` (``generate``, ``stream``,
``encode``), :class:`SamplingParams`, :class:`Completion`, :class:`RunnerOptions`,
:func:`validate_kernels`, :func:`bench`, :func:`kv_quality`, :class:`KvCacheDtype` and
:class:`MetraleError`. Names load on first use, so the command line starts without torch.
"""

from __future__ import annotations

import importlib

from metrale_cli.environment import VERSION as __version__

_EXPORTS = {
    "load": "metrale_cli.api", "LLM": "metrale_cli.engine.llm", "Completion": "metrale_cli.engine.llm",
    "validate_kernels": "metrale_cli.api", "bench": "metrale_cli.api", "kv_quality": "metrale_cli.api",
    "SamplingParams": "metrale_cli.engine.sampler", "RunnerOptions": "metrale_cli.engine.runner",
    "KvCacheDtype": "metrale_cli.kv.dtypes", "MetraleError": "metrale_cli.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'metrale_cli' has no attribute {name!r}")
