"""A checkpoint's recommended sampling: an HF folder's generation_config.json as transformers'
``generate`` reads it, a GGUF file's ``general.sampling.*`` as llama.cpp reads it. A run applies
them where the user set no value of their own (``engine.sampler.with_model_defaults``)."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from metrale_cli.checkpoint.json_file import read_json_object
from metrale_cli.errors import MetraleError

# transformers' GenerationConfig defaults, which its generate uses for a key a do_sample config leaves out
HF_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
HF_KEYS = ("temperature", "top_k", "top_p", "min_p")
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
             "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}

@dataclass(frozen=True)
class SamplingDefaults:
    """``values``: SamplingParams field -> the checkpoint's value, as stored (the run checks those
    it applies); ``source``: where they were read; ``implied``: the fields the source left out that
    its reader's defaults fill."""

    values: dict = field(default_factory=dict)
    source: str = ""
    implied: frozenset = frozenset()


NONE = SamplingDefaults()


def from_generation_config(folder: pathlib.Path) -> SamplingDefaults:
    """generation_config.json's sampling when it sets ``do_sample`` (else greedy), its repetition
    penalty either way, as transformers' generate applies them."""
    config = read_json_object(folder / "generation_config.json", optional=True)
    if not config:
        return NONE
    sample = config.get("do_sample", False)
    if not isinstance(sample, bool):
        raise MetraleError(f"generation_config.json do_sample must be true or false, got {sample!r}",
                           "fix the file")
    keys = (*HF_KEYS, "repetition_penalty") if sample else ("repetition_penalty",)
    given = {k: config[k] for k in keys if config.get(k) is not None}
    values = {**HF_SAMPLING, **given} if sample else given
    return SamplingDefaults(values, "generation_config.json", frozenset(values) - set(given)) if values else NONE


def from_gguf_metadata(meta: dict) -> SamplingDefaults:
    """``general.sampling.*``: the keys the file holds (a temperature of 0 is greedy)."""
    values = {name: meta[key] for key, name in GGUF_KEYS.items() if meta.get(key) is not None}
    return SamplingDefaults(values, "GGUF general.sampling") if values else NONE
