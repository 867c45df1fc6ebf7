"""Where a run's config and weights come from: a checkpoint, read only after the start-up checks,
or weights already in memory (bench presets; ``bench --kv-quality`` runs one checkpoint many times)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from metrale_cli.checkpoint.sampling_defaults import NONE


@dataclass(frozen=True)
class Weights:
    """HF-named tensors on the run's device, the tokenizer (None for random weights), a name."""

    tensors: dict[str, torch.Tensor]
    tokenizer: object | None
    name: str


@dataclass(frozen=True)
class ModelSource:
    """``config``: the HF-style config dict; ``tokenizer()``: read without the weights;
    ``load(device, dtype, progress, transform=None)``: the :class:`Weights`, each tensor through
    ``transform(name, tensor)`` first when given (a tensor-parallel rank's shard)."""

    config: dict
    tokenizer: Callable[[], object | None]
    load: Callable[..., Weights]
    sampling: Callable[[], object] = lambda: NONE  # the checkpoint's recommended sampling (SamplingDefaults)
    sharded: bool = False  # its tensors are already this tensor-parallel rank's shard (on its device)
    resident: bool = False  # its tensors are already in memory (loading them takes no more)

    @classmethod
    def checkpoint(cls, spec: str | None) -> ModelSource:
        """An HF folder, a .gguf file, a hub id, or None for the embedded default model."""
        from metrale_cli.checkpoint import load_checkpoint, read_config, read_sampling_defaults, read_tokenizer

        def load(device, dtype, progress, transform=None):
            ckpt = load_checkpoint(spec, device, dtype, progress, transform)
            return Weights(ckpt.tensors, ckpt.tokenizer, ckpt.source)

        return cls(read_config(spec), lambda: read_tokenizer(spec), load, lambda: read_sampling_defaults(spec))

    @classmethod
    def loaded(cls, config: dict, tensors: dict[str, torch.Tensor], tokenizer=None, name: str = "weights",
               sharded: bool = False) -> ModelSource:
        """Tensors already on the run's device (every build takes a shallow copy of the dict);
        ``sharded``: a tensor-parallel rank's shard of them (metrale_cli/layers/parallel.py)."""
        def load(device, dtype, progress, transform=None):
            kept = dict(tensors) if transform is None else {n: transform(n, t).to(device) for n, t in tensors.items()}
            return Weights(kept, tokenizer, name)

        return cls(config, lambda: tokenizer, load, sharded=sharded, resident=True)
