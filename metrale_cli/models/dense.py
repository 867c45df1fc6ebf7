"""Builder for the dense Llama-style families (Llama, Qwen2, Qwen3): HF weight names -> layers.

The three share HF's ``model.layers.N.{self_attn,mlp}.*`` naming; they differ in which optional
tensors exist (q/k/v biases, QK-norm), which ``expected_tensors`` derives from the config.
"""

from __future__ import annotations

import torch

from metrale_cli.config import ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.layers.attention import AttentionWeights

IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "k_scale", "v_scale", "kv_scale")


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold, with its shape."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.q_size, h),
            p + "self_attn.k_proj.weight": (cfg.kv_size, h),
            p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if cfg.qkv_bias:
            shapes |= {p + f"self_attn.{x}_proj.bias": (s,) for x, s in
                       (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size))}
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Fail with one line on missing, unexpected or mis-shaped tensors."""
    expected = expected_tensors(cfg)
    present = {k for k in tensors if not k.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")
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


def attention_weights(cfg: ModelConfig, t: dict[str, torch.Tensor], n: int) -> AttentionWeights:
    """Pops layer n's attention tensors from ``t`` (so the unfused copies can be freed)."""
    p = f"model.layers.{n}.self_attn."
    qkv = torch.cat([t.pop(p + f"{x}_proj.weight") for x in "qkv"])
    bias = torch.cat([t.pop(p + f"{x}_proj.bias") for x in "qkv"]) if cfg.qkv_bias else None
    return AttentionWeights(
        qkv=qkv,
        o=t.pop(p + "o_proj.weight"),
        qkv_bias=bias,
        o_bias=t.pop(p + "o_proj.bias") if cfg.o_bias else None,
        q_norm=t.pop(p + "q_norm.weight") if cfg.qk_norm else None,
        k_norm=t.pop(p + "k_norm.weight") if cfg.qk_norm else None,
    )


def ffn_weights(t: dict[str, torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pops layer n's FFN tensors: ([gate; up], down)."""
    p = f"model.layers.{n}.mlp."
    gate_up = torch.cat([t.pop(p + "gate_proj.weight"), t.pop(p + "up_proj.weight")])
    return gate_up, t.pop(p + "down_proj.weight")
