"""ModelConfig: the only code that reads HF config keys.

Accepts both the transformers-4 spelling (``rope_theta`` + ``rope_scaling``) that hub checkpoints
carry and the transformers-5 spelling (``rope_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale_cli.errors import MetraleError

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    freq_factors: tuple[float, ...] | None = None  # GGUF rope_freqs: inv_freq[i] / freq_factors[i]


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = attn + 3 * h * i + norms
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def decode_parameters(self) -> int:
        """Parameters a decode step reads whole: every layer, the final norm and the LM head. An
        untied input embedding is only gathered, a row per token, so its table is left out."""
        untied_embed = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_parameters() - untied_embed


def _require(raw: dict, key: str):
    if key not in raw or raw[key] is None:
        raise MetraleError(f"config.json has no '{key}'", hint="is this a complete HF checkpoint?")
    return raw[key]


def _positive_int(raw: dict, key: str) -> int:
    value = _require(raw, key)
    if not isinstance(value, int) or value <= 0:
        raise MetraleError(f"config.json key '{key}' must be a positive integer, got {value!r}")
    return value


def _rope_config(raw: dict) -> RopeConfig:
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise MetraleError(
            f"config.json rope_type '{rope_type}' is not supported",
            hint="supported: " + ", ".join(SUPPORTED_ROPE_TYPES),
        )
    keys = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
            "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
    extra = {k: params[k] for k in keys if params.get(k) is not None}
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if params.get("freq_factors") is not None:
        extra["freq_factors"] = tuple(float(f) for f in params["freq_factors"])
    return RopeConfig(theta=float(theta), rope_type=rope_type, partial_rotary_factor=partial, **extra)


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def model_config_from_hf(raw: dict) -> ModelConfig:
    """Build the frozen ModelConfig from an HF config.json dict; MetraleError names a bad key."""
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise MetraleError(
            f"model_type '{family}' is not supported yet",
            hint="supported families: " + ", ".join(SUPPORTED_FAMILIES),
        )
    if raw.get("mlp_bias"):
        raise MetraleError("config.json mlp_bias=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise MetraleError(f"config.json hidden_act '{raw['hidden_act']}' is not supported (silu only)")
    hidden = _positive_int(raw, "hidden_size")
    heads = _positive_int(raw, "num_attention_heads")
    head_dim = raw.get("head_dim") or hidden // heads
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise MetraleError(
            f"config.json num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    return ModelConfig(
        family=family,
        vocab_size=_positive_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(raw, "intermediate_size"),
        num_layers=_positive_int(raw, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_config(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o_proj bias; the others follow attention_bias.
        qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        o_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
    )
