"""The dense Llama-style families: Llama, Mistral, Qwen2, Qwen3 (HF ``model.layers.N.{self_attn,mlp}.*``).

They differ in which optional tensors exist (q/k/v biases, QK-norm) and in their sliding-window
layers: Qwen2 / Qwen3's (``layer_types``, by default those from ``max_window_layers`` on), and
Mistral's ``sliding_window`` on every layer (transformers' MistralModel masks all of them alike;
Mistral 7B v0.2 on, Nemo and Small have none; layers/spec.py says when a window is served).
Every layer is a :class:`~metrale_cli.layers.attention.Qwen3AttentionLayer` with a dense SwiGLU
FFN. llama.cpp writes Mistral's GGUF files with its ``llama`` architecture, so they load through
the Llama family.
"""

from __future__ import annotations

import torch

from metrale_cli.config import ConfigReader, ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.layers.spec import FfnSpec, LayerSpec
from metrale_cli.models import decoder
from metrale_cli.models.family import BuildParts, Family, GgufArch, check_tensors
from metrale_cli.models.model import CausalLM


def _config(r: ConfigReader, family: str) -> ModelConfig:
    r.refuse("mlp_bias", (False,), "only bias-free MLPs are built")
    r.refuse("hidden_act", ("silu",), "only SiLU (SwiGLU) FFNs are built")
    partial = r.rope().partial_rotary_factor
    if partial != 1:
        raise MetraleError(f"config.json partial_rotary_factor={partial!r} is not supported "
                           f"for {family}", hint="transformers' model of the family rotates every dimension of a head")
    # MistralAttention has no biases whatever attention_bias says (not a key of MistralConfig)
    layers, bias = r.positive_int("num_hidden_layers"), r.flag("attention_bias") and family != "mistral"
    if family == "llama":
        windows = [None] * layers
    elif family == "mistral":
        windows = [r.optional_positive_int("sliding_window")] * layers
    else:
        windows = decoder.windows(r, layers, lambda i, max_window: i >= max_window)
    # Qwen2 always has q/k/v biases and no o_proj bias; the others follow attention_bias.
    attention = decoder.attention_specs(r, windows, qk_norm=family == "qwen3", qkv_bias=family == "qwen2" or bias,
                                        o_bias=family != "qwen2" and bias)
    ffn = FfnSpec("swiglu", r.positive_int("intermediate_size"))
    eps = r.positive_number("rms_norm_eps", 1e-6)
    return ModelConfig.read(r, family, tuple(LayerSpec(i, a, ffn, eps) for i, a in enumerate(attention)))


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold, with its shape."""
    shapes, h = decoder.model_tensors(cfg), cfg.hidden_size
    for spec in cfg.layers:
        shapes |= decoder.attention_tensors(spec, h)
        shapes |= decoder.swiglu_tensors(f"model.layers.{spec.index}.mlp.", spec.ffn.intermediate_size, h)
    return shapes


def build(cfg: ModelConfig, tensors: dict[str, torch.Tensor], parts: BuildParts) -> CausalLM:
    """The layer stack from HF-named ``tensors`` (consumed: entries popped)."""
    check_tensors(cfg, tensors, expected_tensors(cfg))
    layers = [decoder.attention_layer(spec, tensors, decoder.swiglu(f"model.layers.{spec.index}.mlp.", tensors,
                                                                     parts.ops, parts.tp), parts)
              for spec in cfg.layers]
    return decoder.causal_lm(cfg, tensors, layers, parts)


def _family(model_type: str, hf_class: str, gguf: GgufArch) -> Family:
    return Family(model_type, hf_class, lambda r: _config(r, model_type), expected_tensors, build, gguf)


LLAMA = _family("llama", "LlamaForCausalLM", GgufArch("llama", permuted_qk=True))
MISTRAL = Family("mistral", "MistralForCausalLM", lambda r: _config(r, "mistral"), expected_tensors, build)
QWEN2 = _family("qwen2", "Qwen2ForCausalLM", GgufArch("qwen2", attention_bias=True))
QWEN3 = _family("qwen3", "Qwen3ForCausalLM", GgufArch("qwen3"))
