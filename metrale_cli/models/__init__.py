"""Model families, one module each, looked up in one table: ``FAMILIES``.

The supported ``model_type`` list, the unsupported-family error and the GGUF architecture list
are all this table's. :func:`model_config` reads an HF config through its family;
:func:`build_model` builds the planned layer stack and its paged KV cache.
"""

from __future__ import annotations

import torch

from metrale_cli.config import ConfigReader, ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import Ops
from metrale_cli.kv.calibration import KvCalibration
from metrale_cli.kv.fp8 import Fp8ScalePolicy
from metrale_cli.kv.innerq import InnerQPolicy, InnerQSettings
from metrale_cli.kv.paged import KvLayerShape, KvLayout, PagedKvCache
from metrale_cli.models import llama, phi3, qwen3_5, qwen3_next, qwen_moe
from metrale_cli.models.decoder import packed_views
from metrale_cli.models.family import BuildParts, Family
from metrale_cli.models.model import CausalLM
from metrale_cli.layers.parallel import SINGLE, TensorParallel

FAMILIES: dict[str, Family] = {f.model_type: f for f in (llama.LLAMA, llama.MISTRAL, phi3.PHI3, llama.QWEN2,
                                                         llama.QWEN3, qwen_moe.QWEN2_MOE, qwen_moe.QWEN3_MOE, qwen3_next.QWEN3_NEXT,
                                                         qwen3_5.QWEN3_5_TEXT, qwen3_5.QWEN3_5_MOE_TEXT,
                                                         qwen3_5.QWEN3_5, qwen3_5.QWEN3_5_MOE)}


def family_of(model_type: str | None) -> Family:
    """The table's row for an HF ``model_type``; the error names every supported one."""
    if model_type is not None and not isinstance(model_type, str):  # a list is no key of the table
        raise MetraleError(f"config.json key 'model_type' must be a string, got {model_type!r}",
                           hint="supported families: " + ", ".join(FAMILIES))
    if model_type not in FAMILIES:
        raise MetraleError(f"model_type '{model_type}' is not supported yet",
                           hint="supported families: " + ", ".join(FAMILIES))
    return FAMILIES[model_type]


def model_config(raw: dict) -> ModelConfig:
    """The frozen config of an HF ``config.json`` dict, read by its family."""
    return family_of(raw.get("model_type")).config(ConfigReader(raw))


def unused_tensors(raw: dict) -> tuple[tuple[str, str], ...]:
    """The (name prefix, what it is) of the checkpoint tensors an HF config's family does not
    load (``Family.unused``); none for a model type no family serves."""
    family = FAMILIES.get(raw.get("model_type"))
    return family.unused if family is not None else ()


def kv_layout(cfg: ModelConfig) -> KvLayout:
    """What the cache stores for each layer of a planned config (nothing for a layer without KV)."""
    return KvLayout(tuple(KvLayerShape(s.kv_dtype, s.attention.num_kv_heads, s.attention.head_dim) if s.has_kv
                          else None for s in cfg.layers))


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], ops: Ops, num_blocks: int, max_seq_len: int,
                fp8_calibration_tokens: int, device: torch.device,
                innerq: InnerQSettings = InnerQSettings(), max_seqs: int = 8, tp: TensorParallel = SINGLE) -> CausalLM:
    """Build a planned config's layer stack (each layer in its spec's KV dtype) and its paged KV
    cache of ``num_blocks`` blocks; a recurrent layer holds state for ``max_seqs`` sequences at
    once. ``tensors`` is consumed (entries popped). With ``tp`` the config and tensors are a
    tensor-parallel rank's shard (metrale_cli/layers/parallel.py)."""
    kv = PagedKvCache(kv_layout(cfg), num_blocks, device)
    calibration = KvCalibration(Fp8ScalePolicy(kv, tensors, fp8_calibration_tokens), InnerQPolicy(kv, innerq))
    parts = BuildParts(ops, kv, calibration, max_seq_len, cfg.max_position_embeddings, max_seqs, tp=tp)
    return family_of(cfg.family).build(cfg, tensors, parts)


def hold_once(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """A checkpoint's tensors, kept for several builds (a bench's dtypes, HF's model), laid out in
    place so that each build takes the tensors it fuses as views, not copies: under the family's
    canonical names first (a MoE's experts stacked once, not by every build), then each layer's
    tensors copied into one allocation in the family's order of names (decoder.packed_views), a
    layer at a time, so the peak is the weights and one layer. ``cfg``: the config the tensors
    are of (a tensor-parallel rank's shard config for its shard). For tensors in device memory: a
    CPU checkpoint's are maps of its file, whose pages a copy would add to, not replace."""
    family = family_of(cfg.family)
    if family.canonical is not None:
        family.canonical(cfg, tensors)
    layers: dict[str, list[str]] = {}
    for name in family.expected_tensors(cfg):
        if name.startswith("model.layers.") and name in tensors:
            layers.setdefault(name[:name.index(".", len("model.layers.")) + 1], []).append(name)
    for names in layers.values():
        views = packed_views({n: (tensors[n].shape, tensors[n].dtype) for n in names}, tensors[names[0]].device)
        for name, view in views.items():
            tensors[name] = view.copy_(tensors[name])
