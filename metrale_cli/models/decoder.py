"""What the HF Llama-style decoder families share: tensor names and shapes, sliding-window layers,
and building a :class:`~metrale_cli.layers.attention.Qwen3AttentionLayer` and the CausalLM.

HF names every such checkpoint ``model.embed_tokens``, ``model.norm``, ``lm_head`` and, per layer,
``model.layers.N.{input_layernorm,post_attention_layernorm,self_attn.*}``; a SwiGLU is
``{gate,up,down}_proj`` under a prefix (``mlp.``, a MoE's ``mlp.experts.E.`` or
``mlp.shared_expert.``). The family modules (``llama.py``, ``qwen_moe.py``) differ only in their
FFNs and in which attention options their configs set.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from metrale_cli.config import ConfigReader, ModelConfig, check_freq_factors
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import Ops
from metrale_cli.layers.attention import AttentionWeights, Qwen3AttentionLayer
from metrale_cli.layers.ffn import DenseSwiGluFfn
from metrale_cli.layers.protocols import FfnComponent
from metrale_cli.layers.spec import AttentionSpec, LayerSpec
from metrale_cli.models.family import BuildParts
from metrale_cli.models.model import CausalLM
from metrale_cli.layers.parallel import SINGLE, TensorParallel


def window(r: ConfigReader) -> int | None:
    """The sliding window a Qwen-style config gives its sliding layers: ``sliding_window`` when
    ``use_sliding_window``, else none."""
    return r.optional_positive_int("sliding_window") if r.flag("use_sliding_window") else None


LAYER_TYPES = ("full_attention", "sliding_attention")  # a dense Qwen-style config's layer_types


def windows(r: ConfigReader, layers: int, sliding: Callable[[int, int], bool]) -> list[int | None]:
    """Each layer's sliding window as transformers derives it: :func:`window` on the layers
    ``layer_types`` names ``sliding_attention``; without ``layer_types``, on the layers ``i`` for
    which ``sliding(i, max_window_layers)`` holds (the family's default rule)."""
    w, types = window(r), r.get("layer_types")
    if types is None:
        max_window = r.non_negative_int("max_window_layers", 28)
        types = ["sliding_attention" if w is not None and sliding(i, max_window) else "full_attention"
                 for i in range(layers)]
    if not isinstance(types, list):
        raise MetraleError(f"config.json layer_types must list {layers} layer types, got {types!r}")
    if len(types) != layers:
        raise MetraleError(f"config.json layer_types has {len(types)} entries for {layers} layers")
    unknown = sorted({str(kind) for kind in types} - set(LAYER_TYPES))
    if unknown:
        raise MetraleError(f"config.json layer_types names {', '.join(map(repr, unknown))}, not a layer type this "
                           "family has", hint="its layers are " + " or ".join(LAYER_TYPES))
    return [w if kind == "sliding_attention" else None for kind in types]


def attention_specs(r: ConfigReader, layer_windows: list[int | None], **options) -> list[AttentionSpec]:
    """One AttentionSpec per layer: the config's heads, head_dim and RoPE, the layer's window and
    the family's ``options`` (qk_norm, qkv_bias, o_bias)."""
    shape, rope = r.attention_shape(), r.rope()
    check_freq_factors(rope, shape.head_dim)
    return [AttentionSpec(head_dim=shape.head_dim, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                          rope=rope, scale=shape.head_dim**-0.5, sliding_window=w, **options) for w in layer_windows]


def model_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The embedding, final norm and (untied) LM head, with their shapes."""
    h, rows = cfg.hidden_size, cfg.vocab_rows or cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (rows, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (rows, h)
    return shapes


def attention_tensors(spec: LayerSpec, h: int) -> dict[str, tuple[int, ...]]:
    """A layer's two norms and its attention tensors (biases and QK-norm as its spec says)."""
    a, p = spec.attention, f"model.layers.{spec.index}."
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (a.q_size, h),
        p + "self_attn.k_proj.weight": (a.kv_size, h),
        p + "self_attn.v_proj.weight": (a.kv_size, h),
        p + "self_attn.o_proj.weight": (h, a.q_size),
    }
    if a.qkv_bias:
        shapes |= {p + f"self_attn.{x}_proj.bias": (s,) for x, s in (("q", a.q_size), ("k", a.kv_size),
                                                                    ("v", a.kv_size))}
    if a.o_bias:
        shapes[p + "self_attn.o_proj.bias"] = (h,)
    if a.qk_norm:
        shapes |= {p + "self_attn.q_norm.weight": (a.head_dim,), p + "self_attn.k_norm.weight": (a.head_dim,)}
    return shapes


def swiglu_tensors(prefix: str, width: int, h: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU of ``width`` under ``prefix``: gate_proj, up_proj (width, h), down_proj (h, width)."""
    return {prefix + "gate_proj.weight": (width, h), prefix + "up_proj.weight": (width, h),
            prefix + "down_proj.weight": (h, width)}


ALIGN = 256  # bytes: where packed_views starts each run of tensors (the kernels' loads want 16)


def packed_views(layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device) -> dict[str, torch.Tensor]:
    """Uninitialised tensors of ``layout``'s (shape, dtype) by name, as views of one allocation in
    its order: a run of tensors of one dtype and trailing shape (q / k / v, their biases, gate /
    up) starts at a multiple of ALIGN bytes and its tensors follow one another with no gap (at a
    multiple of 16 bytes; else the next starts aligned), so that, laid out in a family's order of
    names, the parts a build fuses are taken by :func:`fused_rows` as views."""
    at, spans, run = 0, {}, None
    for name, (shape, dtype) in layout.items():
        if (tuple(shape[1:]), dtype) != run or at % 16:
            at, run = -(-at // ALIGN) * ALIGN, (tuple(shape[1:]), dtype)
        spans[name] = (at, at + math.prod(shape) * dtype.itemsize)
        at = spans[name][1]
    flat = torch.empty(at + ALIGN, dtype=torch.uint8, device=device)
    base = -flat.data_ptr() % ALIGN
    return {name: flat[base + begin:base + end].view(dtype).view(shape)
            for (name, (shape, dtype)), (begin, end) in zip(layout.items(), spans.values())}


def fused_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, taken as a view where the parts already lie one after the other in one
    storage (contiguous, the same trailing shape: :func:`packed_views` lays them out so), so that a
    build over weights kept for later builds holds no second copy of them."""
    first = parts[0]
    at = first.data_ptr()
    for part in parts:
        if not (part.is_contiguous() and part.dtype == first.dtype and part.device == first.device
                and part.shape[1:] == first.shape[1:] and part.data_ptr() == at
                and part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()):
            return torch.cat(parts)
        at += part.numel() * part.element_size()
    return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride())


def attention_weights(spec: LayerSpec, t: dict[str, torch.Tensor]) -> AttentionWeights:
    """Pops the layer's attention tensors from ``t`` (so the unfused copies can be freed)."""
    a, p = spec.attention, f"model.layers.{spec.index}.self_attn."
    return AttentionWeights(
        qkv=fused_rows([t.pop(p + f"{x}_proj.weight") for x in "qkv"]),
        o=t.pop(p + "o_proj.weight"),
        qkv_bias=fused_rows([t.pop(p + f"{x}_proj.bias") for x in "qkv"]) if a.qkv_bias else None,
        o_bias=t.pop(p + "o_proj.bias") if a.o_bias else None,
        q_norm=t.pop(p + "q_norm.weight") if a.qk_norm else None,
        k_norm=t.pop(p + "k_norm.weight") if a.qk_norm else None,
    )


def swiglu(prefix: str, t: dict[str, torch.Tensor], ops: Ops, tp: TensorParallel = SINGLE) -> DenseSwiGluFfn:
    """The SwiGLU under ``prefix``, its tensors popped from ``t``, gate and up fused; ``tp``: the
    rank whose shard it is, its output summed over the ranks (SINGLE: left a partial sum, as a
    MoE's shared expert, which the MoE sums with its experts)."""
    gate_up = fused_rows([t.pop(prefix + "gate_proj.weight"), t.pop(prefix + "up_proj.weight")])
    return DenseSwiGluFfn(gate_up, t.pop(prefix + "down_proj.weight"), ops, tp)


def attention_layer(spec: LayerSpec, t: dict[str, torch.Tensor], ffn: FfnComponent,
                    parts: BuildParts) -> Qwen3AttentionLayer:
    """The layer's attention (its tensors popped from ``t``) and norms around ``ffn``."""
    p, a = f"model.layers.{spec.index}.", spec.attention
    return Qwen3AttentionLayer(spec, attention_weights(spec, t), t[p + "input_layernorm.weight"],
                               t[p + "post_attention_layernorm.weight"], ffn, parts.ops, parts.kv.layers[spec.index],
                               parts.rope(a.rope, a.head_dim), parts.calibration, parts.tp)


def causal_lm(cfg: ModelConfig, tensors: dict[str, torch.Tensor], layers: list, parts: BuildParts) -> CausalLM:
    """The model around its built ``layers``: embedding, final norm, LM head (tied or not)."""
    embed = tensors["model.embed_tokens.weight"]
    lm_head = embed if cfg.tie_word_embeddings else tensors["lm_head.weight"]
    return CausalLM(cfg, embed, layers, tensors["model.norm.weight"], lm_head, parts.ops, parts.kv,
                    parts.calibration, parts.tp)
