"""The dense Llama-style families: Llama, Qwen2, Qwen3 (HF ``model.layers.N.{self_attn,mlp}.*``).

They differ in which optional tensors exist (q/k/v biases, QK-norm) and in Qwen2 / Qwen3's
sliding-window layers (``layer_types``), which :func:`_specs` reads from the config. Every layer
is a :class:`~metrale_cli.layers.attention.Qwen3AttentionLayer` with a dense SwiGLU FFN.
"""

from __future__ import annotations

import torch

from metrale_cli.config import ConfigReader, ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.layers.attention import AttentionWeights, Qwen3AttentionLayer
from metrale_cli.layers.ffn import DenseSwiGluFfn
from metrale_cli.layers.spec import AttentionSpec, FfnSpec, LayerSpec
from metrale_cli.models.family import BuildParts, Family, GgufArch, check_tensors
from metrale_cli.models.model import CausalLM

def _windows(r: ConfigReader, layers: int) -> list[int | None]:
    """Each layer's sliding window as transformers derives it (Qwen2 / Qwen3 configs): the window
    is ``sliding_window`` when ``use_sliding_window``, on the layers ``layer_types`` names
    ``sliding_attention`` (by default those from ``max_window_layers`` on)."""
    window = r.get("sliding_window") if r.flag("use_sliding_window") else None
    types = r.get("layer_types") or ["sliding_attention" if window is not None and i >= r.get("max_window_layers", 28)
                                     else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise MetraleError(f"config.json layer_types has {len(types)} entries for {layers} layers")
    return [window if kind == "sliding_attention" else None for kind in types]


def _config(r: ConfigReader, family: str) -> ModelConfig:
    r.refuse("mlp_bias", (False,), "only bias-free MLPs are built")
    r.refuse("hidden_act", ("silu",), "only SiLU (SwiGLU) FFNs are built")
    shape, layers = r.attention_shape(), r.positive_int("num_hidden_layers")
    bias = r.flag("attention_bias")
    attention = dict(head_dim=shape.head_dim, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                     rope=r.rope(), scale=shape.head_dim**-0.5, qk_norm=family == "qwen3",
                     # Qwen2 always has q/k/v biases and no o_proj bias; the others follow attention_bias.
                     qkv_bias=family == "qwen2" or bias, o_bias=family != "qwen2" and bias)
    ffn = FfnSpec("swiglu", r.positive_int("intermediate_size"))
    eps = float(r.get("rms_norm_eps", 1e-6))
    windows = _windows(r, layers) if family != "llama" else [None] * layers
    specs = tuple(LayerSpec(i, AttentionSpec(**attention, sliding_window=w), ffn, eps) for i, w in enumerate(windows))
    return ModelConfig.read(r, family, specs)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold, with its shape."""
    h = cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for spec in cfg.layers:
        a, i, p = spec.attention, spec.ffn.intermediate_size, f"model.layers.{spec.index}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (a.q_size, h),
            p + "self_attn.k_proj.weight": (a.kv_size, h),
            p + "self_attn.v_proj.weight": (a.kv_size, h),
            p + "self_attn.o_proj.weight": (h, a.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if a.qkv_bias:
            shapes |= {p + f"self_attn.{x}_proj.bias": (s,) for x, s in (("q", a.q_size), ("k", a.kv_size),
                                                                        ("v", a.kv_size))}
        if a.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if a.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (a.head_dim,), p + "self_attn.k_norm.weight": (a.head_dim,)}
    return shapes


def _attention_weights(spec: LayerSpec, t: dict[str, torch.Tensor]) -> AttentionWeights:
    """Pops the layer's attention tensors from ``t`` (so the unfused copies can be freed)."""
    a, p = spec.attention, f"model.layers.{spec.index}.self_attn."
    return AttentionWeights(
        qkv=torch.cat([t.pop(p + f"{x}_proj.weight") for x in "qkv"]),
        o=t.pop(p + "o_proj.weight"),
        qkv_bias=torch.cat([t.pop(p + f"{x}_proj.bias") for x in "qkv"]) if a.qkv_bias else None,
        o_bias=t.pop(p + "o_proj.bias") if a.o_bias else None,
        q_norm=t.pop(p + "q_norm.weight") if a.qk_norm else None,
        k_norm=t.pop(p + "k_norm.weight") if a.qk_norm else None,
    )


def _layer(spec: LayerSpec, t: dict[str, torch.Tensor], parts: BuildParts) -> Qwen3AttentionLayer:
    p, a = f"model.layers.{spec.index}.", spec.attention
    gate_up = torch.cat([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")])
    ffn = DenseSwiGluFfn(gate_up, t.pop(p + "mlp.down_proj.weight"), parts.ops)
    return Qwen3AttentionLayer(spec, _attention_weights(spec, t), t[p + "input_layernorm.weight"],
                               t[p + "post_attention_layernorm.weight"], ffn, parts.ops, parts.kv.layers[spec.index],
                               parts.rope(a.rope, a.head_dim), parts.calibration)


def build(cfg: ModelConfig, tensors: dict[str, torch.Tensor], parts: BuildParts) -> CausalLM:
    """The layer stack from HF-named ``tensors`` (consumed: entries popped)."""
    check_tensors(cfg, tensors, expected_tensors(cfg))
    layers = [_layer(spec, tensors, parts) for spec in cfg.layers]
    embed = tensors["model.embed_tokens.weight"]
    lm_head = embed if cfg.tie_word_embeddings else tensors["lm_head.weight"]
    return CausalLM(cfg, embed, layers, tensors["model.norm.weight"], lm_head, parts.ops, parts.kv,
                    parts.calibration)


def _family(model_type: str, hf_class: str, gguf: GgufArch) -> Family:
    return Family(model_type, hf_class, lambda r: _config(r, model_type), expected_tensors, build, gguf)


LLAMA = _family("llama", "LlamaForCausalLM", GgufArch("llama", permuted_qk=True))
QWEN2 = _family("qwen2", "Qwen2ForCausalLM", GgufArch("qwen2", attention_bias=True))
QWEN3 = _family("qwen3", "Qwen3ForCausalLM", GgufArch("qwen3"))
