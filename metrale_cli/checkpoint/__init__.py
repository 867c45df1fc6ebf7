"""Checkpoints: HF folders (safetensors, sharded or not), GGUF files, hub ids, embedded default.

``load_checkpoint(spec, device, dtype)`` returns HF-named tensors on the target device plus the
HF-style config and the tokenizer, whatever the file format. ``read_config(spec)`` is the cheap
path (no tensors) for start-up checks.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Callable

import torch

from metrale_cli.checkpoint.gguf_io import (gguf_cache_path, load_gguf, read_gguf_config, read_gguf_sampling,
                                            read_gguf_tokenizer)
from metrale_cli.checkpoint.resolve import Format, ModelLocation, default_model_path, locate
from metrale_cli.checkpoint.sampling_defaults import SamplingDefaults, from_generation_config
from metrale_cli.checkpoint.safetensors_io import Progress, Transform, load_hf_folder_tensors, read_hf_config
from metrale_cli.checkpoint.tokenizer import Tokenizer
from metrale_cli.models import unused_tensors

__all__ = ["Checkpoint", "load_checkpoint", "read_config", "read_tokenizer", "read_sampling_defaults",
           "default_model_path", "gguf_cache_path"]


@dataclass(frozen=True)
class Checkpoint:
    """A loaded model checkpoint.

    config: HF config.json content (for GGUF a synthesized HF-style dict).
    tensors: HF names -> tensors on the target device, in the target dtype (fp8 and integer
        weights are refused as they are not supported yet).
    tokenizer: the model's tokenizer.
    source: what was loaded, for messages, e.g. "SmolLM2-135M-Instruct (gguf Q4_1, /path)"; for
        an HF folder it also names the tensors its family does not load, left unread ("...; not
        loaded: the vision tower (model.visual.*: N tensors, X MiB)").
    """

    config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str


def _load_hf_folder(where: ModelLocation, device, dtype, progress, transform=None) -> Checkpoint:
    config = read_hf_config(where.path)
    tokenizer = Tokenizer.from_hf_folder(where.path)
    tensors, unread = load_hf_folder_tensors(where.path, device, dtype, progress, unused_tensors(config), transform)
    return Checkpoint(config, tensors, tokenizer, f"{where.name} (safetensors, {where.path}"
                      + (f"; {unread}" if unread else "") + ")")


def _load_gguf(where: ModelLocation, device, dtype, progress, transform=None) -> Checkpoint:
    model = load_gguf(where.path, device, dtype, progress, transform)
    cache = gguf_cache_path(where.path)
    how = {"cached": f"dequantized weights read from the cache {cache}",
           "converted": f"dequantized now and cached in {cache} for the next start",
           "uncached": f"dequantized now; the cache {cache} is not writable, so every start converts again"}
    return Checkpoint(model.config, model.tensors, model.tokenizer,
                      f"{where.name} (gguf {model.quant}, {where.path}; {how[model.cache]})")


# weight format -> (loader, config reader, tokenizer reader, recommended-sampling reader)
FORMATS: dict[Format, tuple[Callable[..., Checkpoint], Callable[[pathlib.Path], dict],
                            Callable[[pathlib.Path], Tokenizer], Callable[[pathlib.Path], SamplingDefaults]]] = {
    Format.HF_FOLDER: (_load_hf_folder, read_hf_config, Tokenizer.from_hf_folder, from_generation_config),
    Format.GGUF: (_load_gguf, read_gguf_config, read_gguf_tokenizer, read_gguf_sampling),
}


def load_checkpoint(spec: str | None, device: torch.device, dtype: torch.dtype,
                    progress: Progress | None = None, transform: Transform | None = None) -> Checkpoint:
    """Load ``spec``: None -> embedded default, a folder -> HF folder, *.gguf -> GGUF,
    "owner/name" -> hub id. ``progress(done_bytes, total_bytes)`` is called as tensors load;
    ``transform(name, tensor)`` replaces each tensor as it is read, before it moves to ``device``
    (a tensor-parallel rank's shard). Every user-caused failure is a MetraleError."""
    where = locate(spec)
    loader = FORMATS[where.format][0]
    return loader(where, torch.device(device), dtype, progress, transform)


def read_config(spec: str | None) -> dict:
    """The HF-style config of ``spec`` without loading tensors."""
    where = locate(spec)
    return FORMATS[where.format][1](where.path)


def read_tokenizer(spec: str | None) -> Tokenizer:
    """The tokenizer of ``spec`` without loading tensors (prompts are checked before weights)."""
    where = locate(spec)
    return FORMATS[where.format][2](where.path)


def read_sampling_defaults(spec: str | None) -> SamplingDefaults:
    """The sampling ``spec`` recommends (its generation_config.json or GGUF metadata), unloaded."""
    where = locate(spec)
    return FORMATS[where.format][3](where.path)
