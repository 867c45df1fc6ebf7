"""GGUF metadata -> an HF-style config dict, and llama.cpp tensor names -> HF names.

Which ``general.architecture`` values load is the families' table (``models.FAMILIES``: each
family names its llama.cpp architecture); the key and tensor-name tables here are the rest of
what metrale knows about GGUF files, and a test walks every row.
"""

from __future__ import annotations

import re

import numpy as np

from metrale_cli.errors import MetraleError
from metrale_cli.models import FAMILIES, model_config
from metrale_cli.models.family import Family


# HF config key -> GGUF key suffix after "<arch>."
ARCH_KEYS: dict[str, str] = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "vocab_size": "vocab_size",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
}
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# llama.cpp name (after "blk.N.") -> HF name (after "model.layers.N.")
LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# llama.cpp's stacked experts (after "blk.N."; (E, ...) in HF order) -> the HF name of each
# expert's slice along dim 0 (after "model.layers.N.mlp.experts.E."), as checkpoints store them.
EXPERT_NAMES: dict[str, str] = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors that are not weights: rope_freqs goes into the config (synthesize_config).
IGNORED_NAMES = ("rope_freqs.weight",)

_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def architectures() -> dict[str, Family]:
    """The llama.cpp architectures metrale loads: {``general.architecture``: its family}."""
    return {f.gguf.name: f for f in FAMILIES.values() if f.gguf is not None}


def arch_of(architecture: str) -> Family:
    """The family of a GGUF ``general.architecture``; MetraleError when unsupported."""
    known = architectures()
    if architecture not in known:
        raise MetraleError(f"GGUF architecture {architecture!r} is not supported",
                           f"supported: {', '.join(known)}")
    return known[architecture]


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name of a llama.cpp tensor name; None for tensors HF does not store."""
    if gguf_name in IGNORED_NAMES:
        return None
    if match := _LAYER_RE.match(gguf_name):
        layer, part, kind = match.groups()
        if part in LAYER_NAMES:
            return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    elif (match := _GLOBAL_RE.match(gguf_name)) and match.group(1) in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    raise MetraleError(f"GGUF tensor {gguf_name!r} has no HF equivalent in metrale",
                       "this GGUF variant of the architecture is not supported")


def hf_tensors(gguf_name: str, shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """The HF tensors a llama.cpp tensor of HF-order ``shape`` becomes: [(name, None)] for most,
    one (name, e) per expert for a stacked expert tensor (e: its slice along dim 0), [] for a
    tensor HF does not store."""
    if match := _EXPERTS_RE.match(gguf_name):
        layer, part = match.groups()
        return [(f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_NAMES[part]}.weight", e) for e in range(shape[0])]
    name = hf_name(gguf_name)
    return [] if name is None else [(name, None)]


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: rows (head, pair, half) -> (head, half, pair).

    The converter reorders each head's rows from HF's rotate-half layout to interleaved pairs;
    this restores HF's order. ``weight``: (n_heads * head_dim, ...) for q (n_heads = query heads)
    or k (n_heads = KV heads); works for weights and 1-D biases.
    """
    rows = weight.shape[0]
    grouped = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def permute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of ``unpermute_qk``); used to write GGUFs."""
    rows = weight.shape[0]
    grouped = weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def synthesize_config(meta: dict, shapes: dict[str, tuple[int, ...]],
                      rope_freqs: list[float] | None = None) -> dict:
    """HF-style config of a GGUF file from its metadata (``meta``: key -> python value),
    tensor shapes (``shapes``: llama.cpp name -> HF-order shape; vocab_size follows the
    embedding's rows, which may exceed the token list) and the ``rope_freqs.weight`` values,
    which become ``rope_parameters["freq_factors"]`` (each frequency divided by its factor, as
    llama.cpp applies them)."""
    architecture = meta.get("general.architecture", "")
    family = arch_of(architecture)
    config = {hf_key: meta[f"{architecture}.{key}"] for hf_key, key in ARCH_KEYS.items()
              if f"{architecture}.{key}" in meta}
    missing = [k for k in REQUIRED_KEYS + family.gguf.required if k not in config]
    if missing:
        raise MetraleError(f"GGUF metadata lacks {architecture}.{ARCH_KEYS[missing[0]]}",
                           "the file is incomplete or not a model GGUF")
    heads = config["num_attention_heads"]
    config.setdefault("num_key_value_heads", heads)
    config.setdefault("rms_norm_eps", 1e-6)
    config.setdefault("rope_theta", 10000.0)
    config.setdefault("max_position_embeddings", 4096)
    config.setdefault("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))
    if "token_embd.weight" in shapes:
        config["vocab_size"] = shapes["token_embd.weight"][0]
    config.update(
        model_type=family.model_type,
        architectures=[family.hf_class],
        hidden_act="silu",
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias=family.gguf.attention_bias or "blk.0.attn_q.bias" in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        **dict(family.gguf.fixed),
    )
    config["qkv_bias"] = config["attention_bias"]  # Qwen2-MoE's spelling in transformers 5
    scaling = _rope_scaling(meta, architecture)
    if scaling:
        config["rope_scaling"] = scaling
    # transformers >= 5 spells RoPE settings this way; both spellings agree.
    config["rope_parameters"] = {"rope_type": "default", **(scaling or {}),
                                 "rope_theta": config["rope_theta"]}
    if rope_freqs is not None:
        config["rope_parameters"]["freq_factors"] = list(rope_freqs)
    _check_as_read(config, architecture)
    # key_length is read as the family reads head_dim (a 0 is refused, not replaced); without
    # it, hidden / heads, as the family defaults it, both checked positive by now
    config.setdefault("head_dim", config["hidden_size"] // heads)
    rotated = meta.get(f"{architecture}.rope.dimension_count", config["head_dim"])
    if rotated != config["head_dim"]:
        raise MetraleError(f"GGUF {architecture}.rope.dimension_count {rotated} is not the head_dim "
                           f"{config['head_dim']}: RoPE on part of each head is not built for GGUF files")
    return config


def _check_as_read(config: dict, architecture: str) -> None:
    """Read the config as its family reads it, now: a value the family refuses is then named as
    the file's metadata (the family's checks speak of config.json and its keys)."""
    try:
        model_config(config)
    except MetraleError as exc:
        def gguf_key(m: re.Match) -> str:
            key = ARCH_KEYS.get(m.group(1))
            return f"GGUF metadata {architecture}.{key}" if key else f"GGUF metadata (as config key '{m.group(1)}')"

        message = re.sub(r"config\.json key '(\w+)'", gguf_key, exc.message)
        raise MetraleError(message.replace("config.json", "GGUF metadata"), exc.hint) from None


def _rope_scaling(meta: dict, architecture: str) -> dict | None:
    kind = meta.get(f"{architecture}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(meta.get(f"{architecture}.rope.scaling.factor", 1.0))}
    original = meta.get(f"{architecture}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
