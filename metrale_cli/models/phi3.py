"""Phi-3 and Phi-4 (HF ``Phi3ForCausalLM``): Llama's layers, with q / k / v stored as one
``qkv_proj`` (rows [q; k; v]) and gate / up as one ``gate_up_proj`` (rows [gate; up]), as
transformers holds them, split into Llama's tensors when the layers are built; RoPE on the first
``partial_rotary_factor`` of each head (Phi-4-mini's 0.75); ``sliding_window`` on every layer as
transformers masks it (Phi-3's 4k models: 2047; layers/spec.py says when a window is served). The
128k models' ``longrope`` scaling is refused by the config's RoPE check. No GGUF architecture.
"""

from __future__ import annotations

import torch

from metrale_cli.config import ConfigReader, ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.layers.spec import FfnSpec, LayerSpec
from metrale_cli.models import decoder, llama
from metrale_cli.models.family import BuildParts, Family, check_tensors
from metrale_cli.models.model import CausalLM


def _config(r: ConfigReader) -> ModelConfig:
    r.refuse("hidden_act", ("silu",), "only SiLU (SwiGLU) FFNs are built")
    rope_type = r.rope_type()
    if rope_type != "default":
        raise MetraleError(f"config.json rope_type '{rope_type}' is not supported for phi3",
                           hint="Phi-3 reads 'su' and 'yarn' as longrope, the 128k models' scaling, which is not "
                           "built; transformers' Phi-3 takes no other scaling")
    layers = r.positive_int("num_hidden_layers")
    windows = [r.optional_positive_int("sliding_window")] * layers
    attention = decoder.attention_specs(r, windows, qk_norm=False, qkv_bias=False, o_bias=False)
    ffn = FfnSpec("swiglu", r.positive_int("intermediate_size"))
    eps = r.positive_number("rms_norm_eps", 1e-5)
    return ModelConfig.read(r, "phi3", tuple(LayerSpec(i, a, ffn, eps) for i, a in enumerate(attention)))


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold, with its shape: Llama's, fused."""
    shapes, h = llama.expected_tensors(cfg), cfg.hidden_size
    for spec in cfg.layers:
        a, p, width = spec.attention, f"model.layers.{spec.index}.", spec.ffn.intermediate_size
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            del shapes[p + name + ".weight"]
        shapes[p + "self_attn.qkv_proj.weight"] = (a.q_size + 2 * a.kv_size, h)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * width, h)
    return shapes


def _split(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Each layer's fused tensors as Llama's, in place (a rank's shard: its config's heads and
    width, as the sharder cut the fused rows)."""
    for spec in cfg.layers:
        a, p = spec.attention, f"model.layers.{spec.index}."
        q, k, v = tensors.pop(p + "self_attn.qkv_proj.weight").split([a.q_size, a.kv_size, a.kv_size])
        gate, up = tensors.pop(p + "mlp.gate_up_proj.weight").split(spec.ffn.intermediate_size)
        tensors |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v, p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}


def build(cfg: ModelConfig, tensors: dict[str, torch.Tensor], parts: BuildParts) -> CausalLM:
    """The layer stack from HF-named ``tensors`` (consumed: entries popped)."""
    check_tensors(cfg, tensors, expected_tensors(cfg))
    _split(cfg, tensors)
    return llama.build(cfg, tensors, parts)


PHI3 = Family("phi3", "Phi3ForCausalLM", _config, expected_tensors, build)
