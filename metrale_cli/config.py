"""ModelConfig: the model-wide settings and one LayerSpec per layer, built once from the HF config.

HF ``config.json`` keys are read through :class:`ConfigReader`, here for the keys every family
shares (vocabulary, hidden size, layers, norms, RoPE, attention shape, tokens) and in each family
module (``models/``) for its own. Accepts both the transformers-4 spelling (``rope_theta`` +
``rope_scaling``) that hub checkpoints carry and the transformers-5 spelling (``rope_parameters``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import AUTO, KvCacheDtype, parse_kv_cache_dtype
from metrale_cli.layers.spec import LayerSpec, RopeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class AttentionShape:
    """The attention shape an HF config declares for its layers: heads, KV heads, head_dim."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def _real(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MetraleError(f"config.json key '{key}' must be a number, got {value!r}")
    if not math.isfinite(value):  # JSON's NaN, Infinity and 1e999 parse; no setting means them
        raise MetraleError(f"config.json key '{key}' must be a finite number, got {value!r}")
    return float(value)


def _positive(key: str, value) -> float:
    """A finite number > 0 (an epsilon, a RoPE base: zero or less gives NaN logits, not an error)."""
    if _real(key, value) <= 0:
        raise MetraleError(f"config.json key '{key}' must be a positive number, got {value!r}")
    return float(value)


def _is_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def token_ids(where: str, value) -> list[int]:
    """A key that holds no token id, one, or a list of them (eos_token_id)."""
    ids = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(_is_id(i) for i in ids):
        raise MetraleError(f"{where} must be a token id or a list of token ids, got {value!r}",
                           hint="fix the file, or re-download the checkpoint")
    return [int(i) for i in ids]


def token_id(where: str, value) -> int | None:
    """A key that holds one token id, or none (bos_token_id)."""
    if value is not None and not _is_id(value):
        raise MetraleError(f"{where} must be a token id, got {value!r}",
                           hint="fix the file, or re-download the checkpoint")
    return None if value is None else int(value)


# The RoPE keys each scaled type must give (transformers refuses a config without them); a
# missing original_max_position_embeddings is max_position_embeddings, as transformers takes it.
ROPE_REQUIRED = {"linear": ("factor",), "yarn": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
_POSITIVE_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_REAL_ROPE_KEYS = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
_FLAG_ROPE_KEYS = ("truncate",)


def _check_scaling(rope_type: str, extra: dict) -> None:
    """Refuse a scaled RoPE whose keys are missing, not numbers, or not positive."""
    missing = [k for k in ROPE_REQUIRED.get(rope_type, ()) if k not in extra]
    if missing:
        raise MetraleError(f"config.json rope_type '{rope_type}' needs '{missing[0]}', which the config does not give",
                           hint="fix rope_scaling (or rope_parameters) in config.json")
    for key in _REAL_ROPE_KEYS:
        if key in extra:
            _real(key, extra[key])
    for key in _POSITIVE_ROPE_KEYS:
        if key in extra and _real(key, extra[key]) <= 0:
            raise MetraleError(f"config.json RoPE key '{key}' must be positive, got {extra[key]!r}")
    for key in _FLAG_ROPE_KEYS:
        if key in extra and not isinstance(extra[key], bool):
            raise MetraleError(f"config.json key '{key}' must be true or false, got {extra[key]!r}")
    if rope_type == "llama3" and extra["high_freq_factor"] <= extra["low_freq_factor"]:
        raise MetraleError(f"config.json RoPE high_freq_factor ({extra['high_freq_factor']}) must be greater than "
                           f"low_freq_factor ({extra['low_freq_factor']})")


def _freq_factors(value) -> tuple[float, ...]:
    """GGUF rope_freqs as a config holds them: each rotated pair's frequency is divided by its entry."""
    if not isinstance(value, list):
        raise MetraleError(f"config.json key 'freq_factors' must be a list of positive numbers, got {value!r}",
                           hint="fix rope_scaling (or rope_parameters) in config.json")
    return tuple(_positive("freq_factors", f) for f in value)


def check_freq_factors(rope: RopeConfig, head_dim: int) -> None:
    """Refuse freq_factors that are not one per rotated pair of a head's dims (layers/rope.py
    divides the frequencies by them), once the family has settled head_dim and the rotary part."""
    pairs = int(head_dim * rope.partial_rotary_factor) // 2
    if rope.freq_factors is not None and len(rope.freq_factors) != pairs:
        raise MetraleError(f"config.json RoPE freq_factors has {len(rope.freq_factors)} entries; the rotary "
                           f"dimension {2 * pairs} of head_dim {head_dim} needs {pairs}",
                           hint="fix rope_scaling (or rope_parameters) in config.json")


def _rope_type(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default"))


class ConfigReader:
    """Typed reads of an HF ``config.json`` dict; every failure is one MetraleError naming its key."""

    def __init__(self, raw: dict):
        self.raw = raw

    def get(self, key: str, default=None):
        value = self.raw.get(key)
        return default if value is None else value

    def require(self, key: str):
        if self.raw.get(key) is None:
            raise MetraleError(f"config.json has no '{key}'", hint="is this a complete HF checkpoint?")
        return self.raw[key]

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.require(key) if default is None else self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise MetraleError(f"config.json key '{key}' must be a positive integer, got {value!r}")
        return value

    def non_negative_int(self, key: str, default: int) -> int:
        """A count that may be 0 (``max_window_layers``: no layer below the window's first)."""
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MetraleError(f"config.json key '{key}' must be a non-negative integer, got {value!r}")
        return value

    def optional_positive_int(self, key: str) -> int | None:
        """A key that is unset (None) or a positive integer (``sliding_window``)."""
        return None if self.raw.get(key) is None else self.positive_int(key)

    def positive_number(self, key: str, default: float) -> float:
        return _positive(key, self.get(key, default))

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise MetraleError(f"config.json key '{key}' must be true or false, got {value!r}")
        return value

    def refuse(self, key: str, allowed, why: str) -> None:
        """Fail when ``key`` is set to a value outside ``allowed`` (None counts as unset)."""
        value = self.raw.get(key)
        if value is not None and value not in allowed:
            raise MetraleError(f"config.json {key}={value!r} is not supported", hint=why)

    def attention_shape(self) -> AttentionShape:
        hidden, heads = self.positive_int("hidden_size"), self.positive_int("num_attention_heads")
        kv_heads = self.positive_int("num_key_value_heads", heads)
        if heads % kv_heads:
            raise MetraleError(f"config.json num_attention_heads ({heads}) is not a multiple of "
                               f"num_key_value_heads ({kv_heads})")
        return AttentionShape(heads, kv_heads, self.positive_int("head_dim", hidden // heads))

    def rope_params(self) -> dict:
        """``rope_scaling`` and ``rope_parameters`` merged (transformers 4's and 5's spellings)."""
        params = {}
        for key in ("rope_scaling", "rope_parameters"):
            given = self.raw.get(key) or {}
            if not isinstance(given, dict):
                raise MetraleError(f"config.json {key} must be an object, got {given!r}")
            params.update(given)
        return params

    def rope_type(self) -> str:
        return _rope_type(self.rope_params())

    def rope(self) -> RopeConfig:
        params = self.rope_params()
        rope_type = _rope_type(params)
        theta = _positive("rope_theta", params.get("rope_theta", self.get("rope_theta", 10000.0)))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise MetraleError(f"config.json rope_type '{rope_type}' is not supported",
                               hint="supported: " + ", ".join(SUPPORTED_ROPE_TYPES))
        keys = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
        extra = {k: params[k] for k in keys if params.get(k) is not None}
        _check_scaling(rope_type, extra)
        partial = _real("partial_rotary_factor", params.get("partial_rotary_factor",
                                                            self.get("partial_rotary_factor", 1.0)))
        if not 0 < partial <= 1:
            raise MetraleError(f"config.json partial_rotary_factor must be in (0, 1], got {partial!r}")
        if params.get("freq_factors") is not None:
            extra["freq_factors"] = _freq_factors(params["freq_factors"])
        return RopeConfig(theta=theta, rope_type=rope_type, partial_rotary_factor=partial, **extra)

    def text_config(self, tie_default: bool, model_type: str) -> ConfigReader:
        """A composite (vision-language) config's text model: the keys of ``text_config`` over the
        top level's, but the composite's own ``tie_word_embeddings`` (``tie_default``, its config
        class's default, when absent): transformers' ``*ForConditionalGeneration`` ties its LM
        head by the top level's key, whatever ``text_config`` says. ``model_type``: the text
        model's; a ``text_config`` naming another is refused."""
        text = self.require("text_config")
        if not isinstance(text, dict):
            raise MetraleError(f"config.json text_config must be an object, got {text!r}")
        if text.get("model_type", model_type) != model_type:
            raise MetraleError(f"config.json text_config has model_type {text['model_type']!r}, not {model_type!r}",
                               hint=f"a {self.raw.get('model_type')} checkpoint's text model is {model_type}")
        outer = {k: v for k, v in self.raw.items() if k not in ("text_config", "vision_config")}
        return ConfigReader(outer | text | {"tie_word_embeddings": bool(outer.get("tie_word_embeddings", tie_default))})

    def eos_ids(self) -> tuple[int, ...]:
        return tuple(token_ids("config.json eos_token_id", self.raw.get("eos_token_id")))


@dataclass(frozen=True)
class ModelConfig:
    """What is model-wide (vocabulary, embeddings, final norm, tokens, context) and ``layers``:
    one :class:`LayerSpec` per layer. ``kv_cache_dtype``: the KV dtype the checkpoint declares."""

    family: str
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layers: tuple[LayerSpec, ...]
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    kv_cache_dtype: str | None = None
    # The embedding / LM-head rows this process holds: a tensor-parallel rank's vocabulary shard
    # (metrale_cli/layers/parallel.py), padded; None: all vocab_size of them.
    vocab_rows: int | None = None

    @classmethod
    def read(cls, r: ConfigReader, family: str, layers: tuple[LayerSpec, ...]) -> ModelConfig:
        """The model-wide keys of ``r``, with the family's layers; the final norm's eps is the
        layers' (the family reads it, with its own default: Phi-3's is not Llama's)."""
        return cls(family=family, vocab_size=r.positive_int("vocab_size"), hidden_size=r.positive_int("hidden_size"),
                   rms_norm_eps=layers[0].eps,
                   max_position_embeddings=r.positive_int("max_position_embeddings", 2048),
                   tie_word_embeddings=r.flag("tie_word_embeddings"), layers=layers,
                   bos_token_id=token_id("config.json bos_token_id", r.raw.get("bos_token_id")),
                   eos_token_ids=r.eos_ids(),
                   kv_cache_dtype=r.get("kv_cache_dtype"))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def check_token_ids(self, declared: dict[str, list[int]]) -> None:
        """Refuse a token id the checkpoint's files give (``declared``: "file key" -> ids, as
        ``Tokenizer.declared_ids``) that is no row of this model's vocabulary: an eos id there is
        never sampled, so it never ends an answer, and a bos id there indexes past the embedding."""
        for where, ids in declared.items():
            past = [i for i in ids if i >= self.vocab_size]
            if past:
                raise MetraleError(f"{where} {past[0]} is past the model's vocabulary: vocab_size is "
                                   f"{self.vocab_size}, so token ids are 0 to {self.vocab_size - 1}",
                                   hint="fix the file, or re-download the checkpoint")

    def resolve_kv_dtype(self, requested: KvCacheDtype | str) -> KvCacheDtype:
        """``--kv-cache-dtype`` as parsed: ``auto`` = the checkpoint's declared KV dtype, else bf16."""
        if requested != AUTO:
            return parse_kv_cache_dtype(requested)
        if not self.kv_cache_dtype:
            return KvCacheDtype.BF16
        try:  # the checkpoint's value, not the user's: the error names config.json
            declared = parse_kv_cache_dtype(self.kv_cache_dtype) if isinstance(self.kv_cache_dtype, str) else None
        except MetraleError:
            declared = None
        if declared is None:
            raise MetraleError(f"config.json kv_cache_dtype {self.kv_cache_dtype!r} is not a KV-cache dtype metrale "
                               "serves", hint="pass --kv-cache-dtype to choose one (e.g. bf16 or fp8)")
        return declared if declared != AUTO else KvCacheDtype.BF16

    def planned(self, kv_dtypes: tuple[KvCacheDtype, ...]) -> ModelConfig:
        """This config with each layer's KV dtype set (the run's plan, made once)."""
        if len(kv_dtypes) != self.num_layers:
            raise ValueError(f"{len(kv_dtypes)} KV dtypes for {self.num_layers} layers")
        layers = tuple(dataclasses.replace(s, kv_dtype=d) for s, d in zip(self.layers, kv_dtypes))
        return dataclasses.replace(self, layers=layers)
