"""Model families: one builder per family, looked up in one table."""

from __future__ import annotations

from collections.abc import Callable

import torch

from metrale_cli.config import ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import Ops
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.kv.fp8 import Fp8ScalePolicy
from metrale_cli.kv.innerq import InnerQPolicy, InnerQSettings
from metrale_cli.kv.paged import KvLayout, PagedKvCache
from metrale_cli.kv.precision import layer_dtypes
from metrale_cli.layers.attention import Qwen3AttentionLayer
from metrale_cli.layers.ffn import DenseSwiGluFfn
from metrale_cli.layers.rope import rope_tables
from metrale_cli.models import dense
from metrale_cli.models.model import CausalLM


def build_dense(cfg: ModelConfig, tensors: dict[str, torch.Tensor], ops: Ops, kv: PagedKvCache,
                fp8: Fp8ScalePolicy, innerq: InnerQPolicy, max_seq_len: int) -> CausalLM:
    dense.check_tensors(cfg, tensors)
    device = kv.device
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, max_seq_len, cfg.max_position_embeddings, device)
    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        ffn = DenseSwiGluFfn(*dense.ffn_weights(tensors, n), ops)
        layers.append(Qwen3AttentionLayer(
            n, cfg, tensors[p + "input_layernorm.weight"], dense.attention_weights(cfg, tensors, n),
            tensors[p + "post_attention_layernorm.weight"], ffn, ops, kv, fp8, cos, sin, innerq,
        ))
    embed = tensors["model.embed_tokens.weight"]
    lm_head = embed if cfg.tie_word_embeddings else tensors["lm_head.weight"]
    return CausalLM(cfg, embed, layers, tensors["model.norm.weight"], lm_head, ops, kv, fp8, innerq)


FAMILIES: dict[str, Callable[..., CausalLM]] = {
    "llama": build_dense,
    "qwen2": build_dense,
    "qwen3": build_dense,
}


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], ops: Ops, kv_dtype: KvCacheDtype,
                num_blocks: int, max_seq_len: int, fp8_calibration_tokens: int,
                device: torch.device, high_precision_layers: str | int = 0,
                innerq: InnerQSettings = InnerQSettings(),
                dtypes: tuple[KvCacheDtype, ...] | None = None) -> CausalLM:
    """Build the layer stack and its paged KV cache. ``tensors`` is consumed (entries popped).

    Each layer's KV dtype is ``dtypes`` when given, else ``kv_dtype`` with the high-precision
    boundary layers of ``high_precision_layers`` (``kv/precision.py``) kept in bf16.
    """
    if cfg.family not in FAMILIES:
        raise MetraleError(f"no builder for model family '{cfg.family}'")
    dtypes = dtypes or layer_dtypes(kv_dtype, cfg.num_layers, high_precision_layers)
    layout = KvLayout(cfg.num_kv_heads, cfg.head_dim, dtypes)
    kv = PagedKvCache(layout, num_blocks, device)
    fp8 = Fp8ScalePolicy(kv, tensors, fp8_calibration_tokens)
    return FAMILIES[cfg.family](cfg, tensors, ops, kv, fp8, InnerQPolicy(kv, innerq), max_seq_len)
