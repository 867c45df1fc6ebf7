"""The Qwen mixture-of-experts families: Qwen3-MoE and Qwen2-MoE (HF ``qwen3_moe``, ``qwen2_moe``).

Attention as in the dense Qwen3 (QK-norm; ``attention_bias`` on q/k/v/o) and Qwen2 (q/k/v biases,
``qkv_bias`` in transformers 5, always on in older configs). Layer i's FFN is a
:class:`~metrale_cli.layers.moe.MoeFfn` unless i is in ``mlp_only_layers`` or i + 1 is not a
multiple of ``decoder_sparse_step``; then a dense SwiGLU of ``intermediate_size``. Qwen2-MoE's
MoE adds a shared expert gated by ``sigmoid(shared_expert_gate(x))``.

The model is built from each layer's experts stacked as transformers 5 holds them in memory
(``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)), which are the
tensors MoeFfn reads: random bench weights and HF's state dict are used as they are, with no copy.
Checkpoints hold one tensor per expert, ``mlp.experts.E.{gate,up,down}_proj.weight`` (what
``save_pretrained`` writes and the hub holds; a GGUF's stacked experts are split into these names
when converted); :func:`fuse_experts` stacks those, a layer at a time.
"""

from __future__ import annotations

import re

import torch

from metrale_cli.config import ConfigReader, ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.layers.moe import MoeFfn
from metrale_cli.layers.spec import FfnSpec, LayerSpec, MoeSpec
from metrale_cli.models import decoder
from metrale_cli.models.family import BuildParts, Family, GgufArch, check_tensors
from metrale_cli.models.model import CausalLM

_PER_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def _moe_spec(r: ConfigReader, shared_expert: bool, norm_topk_default: bool) -> MoeSpec:
    # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts (its attribute_map)
    local = r.get("num_experts") is None and r.get("num_local_experts") is not None
    key = "num_local_experts" if local else "num_experts"
    experts, top_k = r.positive_int(key), r.positive_int("num_experts_per_tok")
    if top_k > experts:
        raise MetraleError(f"config.json num_experts_per_tok ({top_k}) exceeds {key} ({experts})")
    shared = r.positive_int("shared_expert_intermediate_size") if shared_expert else 0
    norm = r.flag("norm_topk_prob", norm_topk_default)
    return MoeSpec(experts, top_k, r.positive_int("moe_intermediate_size"), norm, shared)


def _dense_layers(r: ConfigReader, layers: int) -> list[int]:
    dense_layers = r.get("mlp_only_layers", [])
    if not isinstance(dense_layers, list) or not all(isinstance(i, int) for i in dense_layers):
        raise MetraleError(f"config.json mlp_only_layers must be a list of layer indices, got {dense_layers!r}")
    outside = [i for i in dense_layers if not 0 <= i < layers]
    if outside:
        raise MetraleError(f"config.json mlp_only_layers lists layer(s) {outside} outside num_hidden_layers ({layers})",
                           hint=f"layer indices run from 0 to {layers - 1}")
    return dense_layers


def ffn_specs(r: ConfigReader, layers: int, shared_expert: bool, norm_topk_default: bool = False) -> list[FfnSpec]:
    """Each layer's FFN as transformers picks it (Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer /
    Qwen3NextDecoderLayer); ``shared_expert``: the MoE has one (Qwen2-MoE, Qwen3-Next);
    ``norm_topk_default``: the family's config class's ``norm_topk_prob`` when the config has none."""
    dense_layers, step = _dense_layers(r, layers), r.positive_int("decoder_sparse_step", 1)
    sparse = [i not in dense_layers and (i + 1) % step == 0 for i in range(layers)]
    moe = FfnSpec("moe", 0, _moe_spec(r, shared_expert, norm_topk_default))
    dense = FfnSpec("swiglu", r.positive_int("intermediate_size")) if not all(sparse) else None
    return [moe if s else dense for s in sparse]


def _config(r: ConfigReader, family: str) -> ModelConfig:
    r.refuse("hidden_act", ("silu",), "only SiLU (SwiGLU) experts are built")
    layers = r.positive_int("num_hidden_layers")
    if family == "qwen3_moe":  # Qwen3MoeAttention: the config's window on every layer
        windows = [decoder.window(r)] * layers
        bias = r.flag("attention_bias")
        attention = decoder.attention_specs(r, windows, qk_norm=True, qkv_bias=bias, o_bias=bias)
    else:  # Qwen2MoeConfig's default layer_types: the even layers below max_window_layers
        windows = decoder.windows(r, layers, lambda i, max_window: i % 2 == 0 and i < max_window)
        attention = decoder.attention_specs(r, windows, qkv_bias=r.flag("qkv_bias", True))
    eps = r.positive_number("rms_norm_eps", 1e-6)
    ffns = ffn_specs(r, layers, shared_expert=family == "qwen2_moe")
    return ModelConfig.read(r, family, tuple(LayerSpec(i, a, f, eps) for i, (a, f) in enumerate(zip(attention, ffns))))


def ffn_tensors(spec: LayerSpec, h: int) -> dict[str, tuple[int, ...]]:
    """The layer's FFN tensors (``mlp.*``: dense, or the MoE's stacked experts), with their shapes."""
    p, m = f"model.layers.{spec.index}.mlp.", spec.ffn.moe
    if m is None:
        return decoder.swiglu_tensors(p, spec.ffn.intermediate_size, h)
    shapes = {p + "gate.weight": (m.num_experts, h),
              p + "experts.gate_up_proj": (m.num_experts, 2 * m.expert_size, h),
              p + "experts.down_proj": (m.num_experts, h, m.expert_size)}
    if m.shared_expert_size:
        shapes |= decoder.swiglu_tensors(p + "shared_expert.", m.shared_expert_size, h)
        shapes[p + "shared_expert_gate.weight"] = (1, h)
    return shapes


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model is built from, with its shape: each layer's experts stacked, as
    transformers 5 holds them (a checkpoint's per-expert tensors are stacked by :func:`fuse_experts`)."""
    shapes, h = decoder.model_tensors(cfg), cfg.hidden_size
    for spec in cfg.layers:
        shapes |= decoder.attention_tensors(spec, h) | ffn_tensors(spec, h)
    return shapes


def fuse_experts(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """A checkpoint's per-expert tensors (``mlp.experts.E.{gate,up,down}_proj.weight``) -> each
    layer's stacked ``mlp.experts.gate_up_proj`` (E, 2I, H) = [gate; up] per expert and
    ``mlp.experts.down_proj`` (E, H, I), in place, a layer at a time, each expert's tensors popped
    as they are copied in (one layer's experts are held twice at most). A layer's per-expert set
    is checked whole first: a missing, extra or mis-shaped expert tensor is one error line."""
    h = cfg.hidden_size
    for spec in cfg.layers:
        m, prefix = spec.ffn.moe, f"model.layers.{spec.index}.mlp.experts."
        present = {n: t for n, t in tensors.items() if n.startswith(prefix) and _PER_EXPERT.fullmatch(n)}
        if m is None or not present:
            continue
        _refuse_both_layouts(prefix, present, tensors)
        i = m.expert_size
        want = {f"{prefix}{e}.{k}_proj.weight": shape for e in range(m.num_experts)
                for k, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))}
        check_tensors(cfg, present, want)
        first = present[prefix + "0.gate_proj.weight"]
        gate_up = first.new_empty(m.num_experts, 2 * i, h)
        down = first.new_empty(m.num_experts, h, i)
        for e in range(m.num_experts):
            gate_up[e, :i] = tensors.pop(f"{prefix}{e}.gate_proj.weight")
            gate_up[e, i:] = tensors.pop(f"{prefix}{e}.up_proj.weight")
            down[e] = tensors.pop(f"{prefix}{e}.down_proj.weight")
        del present, first
        tensors[prefix + "gate_up_proj"], tensors[prefix + "down_proj"] = gate_up, down


def _refuse_both_layouts(prefix: str, present: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """A layer's experts come stacked or one tensor per expert, never both (one set would be dropped)."""
    stacked = [prefix + n for n in ("gate_up_proj", "down_proj") if prefix + n in tensors]
    if stacked:
        raise MetraleError(f"checkpoint holds {prefix}* both stacked ({stacked[0]}) and one tensor per expert "
                           f"({min(present)})", hint="the checkpoint mixes two layouts of the same experts")


def ffn(spec: LayerSpec, t: dict[str, torch.Tensor], parts: BuildParts):
    """The layer's FFN component, its tensors popped from ``t``."""
    p, m = f"model.layers.{spec.index}.mlp.", spec.ffn.moe
    if m is None:
        return decoder.swiglu(p, t, parts.ops, parts.tp)
    gate_up, down = t.pop(p + "experts.gate_up_proj"), t.pop(p + "experts.down_proj")
    shared = decoder.swiglu(p + "shared_expert.", t, parts.ops) if m.shared_expert_size else None
    shared_gate = t.pop(p + "shared_expert_gate.weight") if m.shared_expert_size else None
    return MoeFfn(m, t.pop(p + "gate.weight"), gate_up, down, parts.ops, shared, shared_gate, parts.tp)


def build(cfg: ModelConfig, tensors: dict[str, torch.Tensor], parts: BuildParts) -> CausalLM:
    """The layer stack from HF-named ``tensors`` (consumed: entries popped), per-expert or stacked."""
    fuse_experts(cfg, tensors)
    check_tensors(cfg, tensors, expected_tensors(cfg))
    layers = [decoder.attention_layer(spec, tensors, ffn(spec, tensors, parts), parts) for spec in cfg.layers]
    return decoder.causal_lm(cfg, tensors, layers, parts)


def _family(model_type: str, hf_class: str, gguf: GgufArch) -> Family:
    return Family(model_type, hf_class, lambda r: _config(r, model_type), expected_tensors, build, gguf, fuse_experts)


# llama.cpp's qwen3moe graph always renormalizes the top-k weights (Qwen3-MoE checkpoints set
# norm_topk_prob); its qwen2moe graph never does (Qwen2-MoE's default).
_EXPERT_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
QWEN2_MOE = _family("qwen2_moe", "Qwen2MoeForCausalLM",
                    GgufArch("qwen2moe", attention_bias=True, fixed=(("norm_topk_prob", False),),
                             required=_EXPERT_KEYS + ("shared_expert_intermediate_size",)))
QWEN3_MOE = _family("qwen3_moe", "Qwen3MoeForCausalLM",
                    GgufArch("qwen3moe", fixed=(("norm_topk_prob", True),), required=_EXPERT_KEYS))
