"""A model family: what one module (``models/<family>.py``) hands the ``FAMILIES`` table.

A family reads its HF config into a :class:`~metrale_cli.config.ModelConfig` (one LayerSpec per
layer), names the tensors its checkpoints hold, builds the layer stack from them, and says how
llama.cpp spells it in GGUF files (:class:`GgufArch`), so the GGUF loader's architecture list is
the families'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from metrale_cli.config import ConfigReader, ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import Ops
from metrale_cli.kv.calibration import KvCalibration
from metrale_cli.kv.paged import PagedKvCache
from metrale_cli.layers.rope import rope_tables
from metrale_cli.layers.spec import RopeConfig
from metrale_cli.layers.parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class GgufArch:
    """How llama.cpp names and stores the family: ``general.architecture``, the q/k row
    permutation of its converter (for rotate-half RoPE), q/k/v biases the family always has,
    ``fixed``: HF config values llama.cpp's graph of the architecture fixes rather than reads
    from the file's metadata, and ``required``: the HF config keys, beyond every family's, whose
    metadata the file must hold (a MoE's expert counts)."""

    name: str
    permuted_qk: bool = False
    attention_bias: bool = False
    fixed: tuple[tuple[str, object], ...] = ()
    required: tuple[str, ...] = ()


@dataclass
class BuildParts:
    """What every family's builder takes besides its config and tensors: the backend, the KV
    cache (a LayerKv per layer, in each layer's planned dtype), its calibrations, RoPE tables
    for ``max_seq_len`` positions (computed once per distinct RoPE and head_dim), and how many
    sequences a recurrent layer's state pool holds (``max_seqs``), and the tensor-parallel rank
    the layers' shards belong to (``tp``: their row-parallel outputs are summed over the ranks)."""

    ops: Ops
    kv: PagedKvCache
    calibration: KvCalibration
    max_seq_len: int
    model_max_positions: int
    max_seqs: int = 8
    ssm_pool: object = None  # a hybrid's SsmStatePool, made by its family's build before its layers
    tp: TensorParallel = SINGLE  # this process's tensor-parallel rank (metrale_cli/layers/parallel.py)
    _tables: dict = field(default_factory=dict)

    def rope(self, rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rope, head_dim)
        if key not in self._tables:
            self._tables[key] = rope_tables(rope, head_dim, self.max_seq_len, self.model_max_positions, self.kv.device)
        return self._tables[key]


@dataclass(frozen=True)
class Family:
    """One row of ``FAMILIES``: an HF ``model_type`` and the functions of its module."""

    model_type: str
    hf_class: str  # the HF ``architectures`` entry
    config: Callable[[ConfigReader], ModelConfig]
    expected_tensors: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    build: Callable[..., object]  # (ModelConfig, tensors, BuildParts) -> CausalLM
    gguf: GgufArch | None = None
    # A checkpoint's tensors -> the names ``expected_tensors`` lists, in place (stacking a MoE
    # checkpoint's per-expert tensors); None when they are the same.
    canonical: Callable[[ModelConfig, dict], None] | None = None
    # Checkpoint tensors the family does not load, by name prefix, each with what it is (a
    # vision-language checkpoint's vision tower, a multi-token-prediction head): an HF folder's
    # loader leaves them unread and says so in one line.
    unused: tuple[tuple[str, str], ...] = ()


# Checkpoint tensors that are not weights (online-KV scales are read by kv/fp8.py).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "k_scale", "v_scale", "kv_scale")


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def weight_names(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> set[str]:
    """The names of the checkpoint's tensors that are weights of the model: not the entries that
    are not weights, nor the copy of the embedding a tied model's checkpoint may hold as lm_head."""
    present = {k for k in tensors if not k.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")
    return present


def check_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    """Fail with one line on missing, unexpected or mis-shaped tensors."""
    present = weight_names(cfg, tensors)
    missing = sorted(set(expected) - present)
    if missing:
        raise MetraleError(f"checkpoint is missing {len(missing)} tensor(s): {_listing(missing)}",
                           hint="the checkpoint is partial or does not match config.json")
    extra = sorted(present - set(expected))
    if extra:
        raise MetraleError(f"checkpoint has {len(extra)} unexpected tensor(s): {_listing(extra)}",
                           hint=f"config.json says model_type '{cfg.family}'")
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise MetraleError(f"tensor {name} has shape {tuple(t.shape)}, config.json implies {shape}")
        if not t.is_floating_point():
            raise MetraleError(f"tensor {name} has dtype {t.dtype}; expected a floating-point weight")
    if cfg.tie_word_embeddings:
        _check_tied_head(tensors)


def _check_tied_head(tensors: dict[str, torch.Tensor]) -> None:
    """A tied model's checkpoint may hold its LM head only as a copy of the embedding: transformers 5
    runs a different one untied, transformers 4 ties it away, so which the model means is unclear."""
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if head is not None and embed is not None and not torch.equal(head, embed):
        raise MetraleError("config.json sets tie_word_embeddings, but the checkpoint's lm_head.weight is not a copy "
                           "of model.embed_tokens.weight", hint="set tie_word_embeddings to false in config.json to "
                           "run the checkpoint's LM head, or remove it from the checkpoint to tie the embedding")
