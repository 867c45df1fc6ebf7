"""The Qwen3-Next hybrid (HF ``qwen3_next``, ``Qwen3NextForCausalLM``).

Layer i is Gated DeltaNet linear attention where ``layer_types`` says ``linear_attention``
(without it, every layer but each ``full_attention_interval``-th, 4 by default: three of four),
else full attention with QK-norm, partial RoPE (``partial_rotary_factor``, 0.25 unless the config
says otherwise) and a sigmoid output gate: q_proj yields, per head, [query; gate]. FFNs as in
Qwen2-MoE (:mod:`~metrale_cli.models.qwen_moe`): a MoE with a shared expert behind
sigmoid(shared_expert_gate(x)), dense on ``mlp_only_layers`` and off the ``decoder_sparse_step``.

HF's Qwen3NextRMSNorm is zero-centred: (1 + weight) * norm(x.float()), cast once. Its weights
(input / post-attention / final norms, QK-norms) get the 1 added at load, in fp32, so the
norm is the backends' plain one: bit-equal to HF in fp32. In bf16 the stored 1 + weight is
rounded to bf16 and the product rounds again (HF rounds once, from fp32): about one bf16 ulp
per norm output. The GDN's gated norm is a plain weight. Checkpoints' multi-token-prediction
head (``mtp.*``), which HF also skips, is not loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from metrale_cli.config import ConfigReader, ModelConfig, check_freq_factors
from metrale_cli.errors import MetraleError
from metrale_cli.layers.attention import AttentionWeights, Qwen3AttentionLayer
from metrale_cli.layers.gdn import GatedDeltaNetLayer, GdnWeights, SsmStatePool
from metrale_cli.layers.spec import AttentionSpec, FfnSpec, GdnSpec, LayerSpec
from metrale_cli.models import decoder, qwen_moe
from metrale_cli.models.family import BuildParts, Family, check_tensors
from metrale_cli.models.model import CausalLM

LAYER_TYPES = {"linear_attention": "gdn", "full_attention": "attention", "attention": "attention",
               "mamba": "gdn"}  # the last two: transformers' legacy spellings


def _mixers(r: ConfigReader, layers: int) -> list[str]:
    types = r.get("layer_types")
    if types is None:
        interval = r.positive_int("full_attention_interval", 4)
        return ["attention" if (i + 1) % interval == 0 else "gdn" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise MetraleError(f"config.json layer_types must list {layers} layer types, got {types!r}")
    # repr, not the entries: a list entry is no key of LAYER_TYPES nor of a set
    unknown = sorted({repr(t) for t in types if not isinstance(t, str) or t not in LAYER_TYPES})
    if unknown:
        raise MetraleError(f"config.json layer_types has unknown type(s) [{', '.join(unknown)}]",
                           hint="expected linear_attention or full_attention")
    return [LAYER_TYPES[t] for t in types]


def _attention(r: ConfigReader) -> AttentionSpec:
    shape, rope = r.attention_shape(), r.rope()
    given = (r.get("rope_parameters") or {}).get("partial_rotary_factor", r.get("partial_rotary_factor"))
    if given is None:  # Qwen3NextConfig's default
        rope = dataclasses.replace(rope, partial_rotary_factor=0.25)
    rotary = shape.head_dim * rope.partial_rotary_factor
    if not 0 < rope.partial_rotary_factor <= 1 or int(rotary) % 2:
        raise MetraleError(f"config.json partial_rotary_factor {rope.partial_rotary_factor!r} rotates {rotary:g} "
                           f"of {shape.head_dim} dims; it must rotate an even number of them")
    check_freq_factors(rope, shape.head_dim)
    return AttentionSpec(head_dim=shape.head_dim, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                         rope=rope, scale=shape.head_dim**-0.5, qk_norm=True, output_gate=True)


def _gdn(r: ConfigReader) -> GdnSpec:
    spec = GdnSpec(r.positive_int("linear_num_key_heads"), r.positive_int("linear_num_value_heads"),
                   r.positive_int("linear_key_head_dim"), r.positive_int("linear_value_head_dim"),
                   r.positive_int("linear_conv_kernel_dim"))
    if spec.num_v_heads % spec.num_k_heads:
        raise MetraleError(f"config.json linear_num_value_heads ({spec.num_v_heads}) is not a multiple of "
                           f"linear_num_key_heads ({spec.num_k_heads})")
    if spec.conv_kernel < 2:
        raise MetraleError(f"config.json linear_conv_kernel_dim must be at least 2, got {spec.conv_kernel}")
    return spec


def hybrid_config(r: ConfigReader, family: str,
                  ffn_specs: Callable[[ConfigReader, int], list[FfnSpec]]) -> ModelConfig:
    """A Qwen3-Next-style hybrid's config (its mixers as the module docstring says), each
    layer's FFN as the family's ``ffn_specs(r, layers)`` says."""
    r.refuse("hidden_act", ("silu",), "only SiLU (SwiGLU) FFNs and SiLU convs are built")
    r.refuse("attention_bias", (False,), "the hybrids' gated attention is built without q/k/v/o biases")
    layers = r.positive_int("num_hidden_layers")
    mixers, eps = _mixers(r, layers), r.positive_number("rms_norm_eps", 1e-6)
    attention = _attention(r) if "attention" in mixers else None
    gdn = _gdn(r) if "gdn" in mixers else None
    ffns = ffn_specs(r, layers)
    specs = tuple(LayerSpec(i, attention if m == "attention" else None, f, eps, mixer=m,
                            gdn=gdn if m == "gdn" else None) for i, (m, f) in enumerate(zip(mixers, ffns)))
    return ModelConfig.read(r, family, specs)


def _ffn_specs(r: ConfigReader, layers: int) -> list[FfnSpec]:
    if r.get("num_experts") == 0:  # Qwen3NextDecoderLayer: no experts, a dense MLP everywhere
        return [FfnSpec("swiglu", r.positive_int("intermediate_size"))] * layers
    return qwen_moe.ffn_specs(r, layers, shared_expert=True, norm_topk_default=True)  # Qwen3NextConfig's


def _config(r: ConfigReader) -> ModelConfig:
    return hybrid_config(r, "qwen3_next", _ffn_specs)


# --- tensors ----------------------------------------------------------------------------------------
def _attention_tensors(spec: LayerSpec, h: int) -> dict[str, tuple[int, ...]]:
    shapes = decoder.attention_tensors(spec, h)
    shapes[f"model.layers.{spec.index}.self_attn.q_proj.weight"] = (2 * spec.attention.q_size, h)  # [query; gate]
    return shapes


@dataclass(frozen=True)
class GdnInProj:
    """How a hybrid's checkpoint stores a GDN layer's input projection: ``shapes(gdn, prefix, h)``
    names its tensors under ``prefix`` (``model.layers.N.linear_attn.``) with their shapes;
    ``rows(gdn, prefix, t)`` pops them from ``t`` as ``GdnWeights.in_proj``, rows [q; k; v; z; b; a]
    head-major."""

    shapes: Callable[[GdnSpec, str, int], dict[str, tuple[int, ...]]]
    rows: Callable[[GdnSpec, str, dict[str, torch.Tensor]], torch.Tensor]


def _qkvz_ba_shapes(g: GdnSpec, a: str, h: int) -> dict[str, tuple[int, ...]]:
    return {a + "in_proj_qkvz.weight": (2 * g.key_dim + 2 * g.value_dim, h),
            a + "in_proj_ba.weight": (2 * g.num_v_heads, h)}


def _qkvz_ba_rows(g: GdnSpec, a: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF's in_proj_qkvz rows are grouped per key head, [q (Dk); k (Dk); v (r*Dv); z (r*Dv)] for
    each of Hk groups (r = Hv / Hk), and in_proj_ba's [b (r); a (r)]: regrouped head-major into
    one projection [q; k; v; z; b; a] (q, k, v then in the conv's channel order)."""
    r = g.num_v_heads // g.num_k_heads
    qkvz = t.pop(a + "in_proj_qkvz.weight").view(g.num_k_heads, 2 * g.head_k_dim + 2 * r * g.head_v_dim, -1)
    ba = t.pop(a + "in_proj_ba.weight").view(g.num_k_heads, 2 * r, -1)
    parts = [*qkvz.split([g.head_k_dim, g.head_k_dim, r * g.head_v_dim, r * g.head_v_dim], dim=1),
             *ba.split([r, r], dim=1)]
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in parts])


INTERLEAVED = GdnInProj(_qkvz_ba_shapes, _qkvz_ba_rows)  # Qwen3-Next's in_proj_qkvz + in_proj_ba


def _gdn_tensors(spec: LayerSpec, h: int, in_proj: GdnInProj) -> dict[str, tuple[int, ...]]:
    g, p = spec.gdn, f"model.layers.{spec.index}."
    a = p + "linear_attn."
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            **in_proj.shapes(g, a, h), a + "conv1d.weight": (g.conv_dim, 1, g.conv_kernel),
            a + "dt_bias": (g.num_v_heads,), a + "A_log": (g.num_v_heads,),
            a + "norm.weight": (g.head_v_dim,), a + "out_proj.weight": (h, g.value_dim)}


def expected_tensors(cfg: ModelConfig, in_proj: GdnInProj = INTERLEAVED) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model is built from, with its shape (experts stacked)."""
    shapes, h = decoder.model_tensors(cfg), cfg.hidden_size
    for spec in cfg.layers:
        mixer = _attention_tensors(spec, h) if spec.has_kv else _gdn_tensors(spec, h, in_proj)
        shapes |= mixer | qwen_moe.ffn_tensors(spec, h)
    return shapes


def canonical(cfg: ModelConfig, tensors: dict) -> None:
    """Drop the multi-token-prediction head (``mtp.*``: HF skips it too), stack the experts."""
    for name in [n for n in tensors if n.startswith("mtp.")]:
        del tensors[name]
    qwen_moe.fuse_experts(cfg, tensors)


def zero_centred_norms(cfg: ModelConfig) -> list[str]:
    """The Qwen3NextRMSNorm weights, applied as (1 + weight)."""
    names = ["model.norm.weight"]
    for spec in cfg.layers:
        p = f"model.layers.{spec.index}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if spec.has_kv:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


# --- the build ------------------------------------------------------------------------------------
def _gated_attention_weights(spec: LayerSpec, t: dict[str, torch.Tensor]) -> AttentionWeights:
    """HF's q_proj rows are, per head, [query (D); gate (D)]: regrouped as [q; k; v; gate]."""
    a, p = spec.attention, f"model.layers.{spec.index}.self_attn."
    per_head = t.pop(p + "q_proj.weight").view(a.num_heads, 2, a.head_dim, -1)
    query, gate = (per_head[:, i].reshape(a.q_size, -1) for i in (0, 1))
    return AttentionWeights(qkv=torch.cat([query, t.pop(p + "k_proj.weight"), t.pop(p + "v_proj.weight"), gate]),
                            o=t.pop(p + "o_proj.weight"), q_norm=t.pop(p + "q_norm.weight"),
                            k_norm=t.pop(p + "k_norm.weight"))


def _gdn_weights(spec: LayerSpec, t: dict[str, torch.Tensor], in_proj: GdnInProj) -> GdnWeights:
    g, p = spec.gdn, f"model.layers.{spec.index}.linear_attn."
    return GdnWeights(in_proj=in_proj.rows(g, p, t), conv=t.pop(p + "conv1d.weight")[:, 0],
                      dt_bias=t.pop(p + "dt_bias").float(), a_log=t.pop(p + "A_log").float(),
                      norm=t.pop(p + "norm.weight"), out=t.pop(p + "out_proj.weight"))


def _layer(spec: LayerSpec, t: dict[str, torch.Tensor], parts: BuildParts, in_proj: GdnInProj):
    p = f"model.layers.{spec.index}."
    norms = t.pop(p + "input_layernorm.weight"), t.pop(p + "post_attention_layernorm.weight")
    if spec.has_kv:
        weights = _gated_attention_weights(spec, t)
        ffn = qwen_moe.ffn(spec, t, parts)
        a = spec.attention
        return Qwen3AttentionLayer(spec, weights, *norms, ffn, parts.ops, parts.kv.layers[spec.index],
                                   parts.rope(a.rope, a.head_dim), parts.calibration, parts.tp)
    weights = _gdn_weights(spec, t, in_proj)
    return GatedDeltaNetLayer(spec, weights, *norms, qwen_moe.ffn(spec, t, parts), parts.ops, parts.ssm_pool,
                              parts.tp)


def build(cfg: ModelConfig, tensors: dict[str, torch.Tensor], parts: BuildParts) -> CausalLM:
    """The layer stack from HF-named ``tensors`` (consumed: entries popped), per-expert or stacked."""
    canonical(cfg, tensors)
    return build_layers(cfg, tensors, parts, INTERLEAVED)


def build_layers(cfg: ModelConfig, tensors: dict[str, torch.Tensor], parts: BuildParts,
                 in_proj: GdnInProj) -> CausalLM:
    """A hybrid's layer stack from ``tensors`` under the names ``expected_tensors(cfg, in_proj)``
    lists (a family's canonical names; consumed)."""
    check_tensors(cfg, tensors, expected_tensors(cfg, in_proj))
    for name in zero_centred_norms(cfg):
        tensors[name] = (tensors[name].float() + 1.0).to(tensors[name].dtype)
    parts.ssm_pool = SsmStatePool([s for s in cfg.layers if s.gdn is not None], parts.max_seqs, parts.kv.device)
    layers = [_layer(spec, tensors, parts, in_proj) for spec in cfg.layers]
    return decoder.causal_lm(cfg, tensors, layers, parts)


QWEN3_NEXT = Family("qwen3_next", "Qwen3NextForCausalLM", _config, expected_tensors, build, None, canonical)
