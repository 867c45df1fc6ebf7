"""LayerSpec: what one layer is, filled once by its family from the HF config; the layers read it.

The seed engine configures a layer through setters (``set_dimension_overrides``,
``set_sliding_window``, ``set_rope_overrides``, ``set_attn_scale_override``, ``set_k_eq_v``, ...);
here those settings are data: a frozen :class:`LayerSpec` per layer, holding an
:class:`AttentionSpec` and an :class:`FfnSpec`. A field that no kernel or layer serves yet is
refused at start-up (:func:`unserved`), naming the layer and the field, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import KvCacheDtype


@dataclass(frozen=True)
class RopeConfig:
    """A layer's rotary embedding: theta, rotary fraction of head_dim, scaling (HF's rope_type)."""

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
    proportional: bool = False  # Gemma-4: rotary_dim counts the non-zero rotation pairs


@dataclass(frozen=True)
class AttentionSpec:
    """A full-attention mixer: heads and head_dim of this layer, its RoPE, scale and options."""

    head_dim: int
    num_heads: int
    num_kv_heads: int
    rope: RopeConfig
    scale: float  # softmax(q·k · scale): head_dim ** -0.5 unless the family overrides it
    qk_norm: bool = False  # RMSNorm of each q / k head before RoPE
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None  # attend to the last N positions only
    output_gate: bool = False  # Qwen3-Next: sigmoid(gate) * attention output, before o_proj
    k_eq_v: bool = False  # Gemma-4 full attention: V is K (after its norm)
    v_norm: bool = False  # a pure RMSNorm of each V head

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts FFN: ``num_experts`` SwiGLU experts of width ``expert_size``, each
    token sent to its ``top_k`` by a linear router (softmax over all experts, top-k, renormalized
    to sum 1 when ``norm_topk_prob``), their outputs summed with those weights. With
    ``shared_expert_size`` a shared SwiGLU expert (Qwen2-MoE, Qwen3-Next) adds
    sigmoid(shared_gate(x)) * shared(x)."""

    num_experts: int
    top_k: int
    expert_size: int
    norm_topk_prob: bool
    shared_expert_size: int = 0


@dataclass(frozen=True)
class FfnSpec:
    """The layer's FFN component: ``swiglu`` = down(silu(gate(x)) * up(x)) of width
    ``intermediate_size``; ``moe`` = the mixture of experts ``moe`` (``intermediate_size`` 0)."""

    kind: str
    intermediate_size: int
    moe: MoeSpec | None = None


@dataclass(frozen=True)
class GdnSpec:
    """A Gated DeltaNet linear-attention mixer (Qwen3-Next / Qwen3.5 ``linear_attention`` layers):
    ``num_k_heads`` query / key heads of ``head_k_dim``, ``num_v_heads`` value heads of
    ``head_v_dim`` (a multiple of the key heads: each key head serves ``num_v_heads //
    num_k_heads`` value heads), a causal depthwise conv of ``conv_kernel`` taps over q, k and v.
    Per sequence it keeps the conv's last ``conv_kernel`` inputs (``conv_kernel - 1`` are read, one
    more so a decode step's writes never race its reads) and a (head_k_dim, head_v_dim) state per
    value head, both fp32."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self) -> int:
        """Bytes of one sequence's state: the conv window and the recurrent state, fp32."""
        return 4 * (self.conv_dim * self.conv_kernel + self.num_v_heads * self.head_k_dim * self.head_v_dim)

    def step_read_bytes(self) -> int:
        """Bytes of a sequence's state one decode step reads: the conv's K - 1 earlier inputs and
        the recurrent state (it writes the state back and one conv input)."""
        return 4 * (self.conv_dim * (self.conv_kernel - 1) + self.num_v_heads * self.head_k_dim * self.head_v_dim)


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its mixer, its FFN, the norms around each sub-layer, its KV dtype.

    ``mixer`` ``attention``: full attention as ``attention`` says, its K / V in the paged cache;
    ``gdn``: Gated DeltaNet as ``gdn`` says (``attention`` None), a recurrent state per sequence
    and no KV cache. Every layer has a pre-norm before each sub-layer (HF's input_layernorm and
    post_attention_layernorm); ``post_attention_norm`` / ``post_ffn_norm`` are the extra norms of
    sandwich-norm families on each sub-layer's output. ``kv_dtype`` is set by the run's plan
    (``ModelConfig.planned``); bf16 until then, and unused by a layer without KV.
    """

    index: int
    attention: AttentionSpec | None
    ffn: FfnSpec
    eps: float
    mixer: str = "attention"
    gdn: GdnSpec | None = None
    post_attention_norm: bool = False
    post_ffn_norm: bool = False
    layer_scalar: float | None = None  # hidden *= scalar at the end of the layer
    kv_dtype: KvCacheDtype = KvCacheDtype.BF16

    def __post_init__(self):
        if (self.mixer == "attention" and self.attention is None) or (self.mixer == "gdn" and self.gdn is None):
            raise ValueError(f"layer {self.index}: a {self.mixer!r} mixer comes with its spec")

    @property
    def has_kv(self) -> bool:
        """Whether this layer keeps K / V in the paged cache (full attention does, GDN does not)."""
        return self.attention is not None


@dataclass(frozen=True)
class _Unserved:
    """A spec field and the reason no kernel or layer serves a value of it other than ``default``
    (or one of ``served``) yet; ``covers``: a value of at least the run's context is served too (a
    sliding window that long masks nothing). ``why`` may name the value as ``{value}``."""

    path: str
    why: str
    default: object = field(default=None)
    served: tuple = ()
    covers: bool = False


UNSERVED = (
    _Unserved("mixer", "only full-attention and Gated DeltaNet layers are built", "attention", ("gdn",)),
    _Unserved("attention.sliding_window", "no attention kernel applies a sliding window yet (with --max-seq-len "
              "{value} or less the window masks nothing, and the model runs)", covers=True),
    _Unserved("attention.k_eq_v", "K=V attention is not built yet", False),
    _Unserved("attention.v_norm", "the V-head norm is not built yet", False),
    _Unserved("attention.rope.proportional", "proportional RoPE is not built yet", False),
    _Unserved("post_attention_norm", "post-sublayer norms are not built yet", False),
    _Unserved("post_ffn_norm", "post-sublayer norms are not built yet", False),
    _Unserved("layer_scalar", "the per-layer scalar is not built yet"),
)


def _value(spec: LayerSpec, path: str):
    """The field at ``path``; None where the path goes through an absent mixer spec."""
    value = spec
    for name in path.split("."):
        value = getattr(value, name) if value is not None else None
    return value


def _is_served(rule: _Unserved, value, context: int | None) -> bool:
    if rule.covers and value is not None and context is not None and value >= context:
        return True
    return value is None or value == rule.default or value in rule.served


def unserved(specs: tuple[LayerSpec, ...], context: int | None = None) -> list[str]:
    """One line per spec field that some layer sets and nothing serves (in a run of ``context``
    tokens, where given): the first such layer, how many more, the value and why."""
    lines = []
    for rule in UNSERVED:
        layers = [s.index for s in specs if not _is_served(rule, _value(s, rule.path), context)]
        if layers:
            more = f" (and {len(layers) - 1} more)" if len(layers) > 1 else ""
            value = _value(specs[layers[0]], rule.path)
            why = rule.why.format(value=value)
            lines.append(f"layer {layers[0]}{more}: {rule.path.split('.')[-1]} = {value!r}: {why}")
    return lines


def check_served(specs: tuple[LayerSpec, ...], context: int | None = None) -> None:
    """Refuse a model with a layer setting a field that nothing serves yet (in a run of
    ``context`` tokens): one error line."""
    problems = unserved(specs, context)
    if problems:
        raise MetraleError("this model needs what metrale does not build yet: " + "; ".join(problems),
                           hint="the layer's spec is refused, not ignored: running it without that field "
                           "would give wrong output")
