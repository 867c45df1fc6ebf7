"""The Qwen3.5 hybrids, dense and MoE, from text-only and vision-language checkpoints.

transformers 5.17 names four model types; each is built here as the one text model:

- ``qwen3_5_text`` (``Qwen3_5ForCausalLM``): a dense SwiGLU FFN (``intermediate_size``) on
  every layer;
- ``qwen3_5_moe_text`` (``Qwen3_5MoeForCausalLM``): a MoE with a shared expert behind
  sigmoid(shared_expert_gate(x)) on every layer;
- ``qwen3_5`` / ``qwen3_5_moe`` (``Qwen3_5ForConditionalGeneration`` /
  ``Qwen3_5MoeForConditionalGeneration``), the published checkpoints: the text model's config
  nested under ``text_config`` (:meth:`ConfigReader.text_config`: the LM head is tied by the
  top level's ``tie_word_embeddings``), its tensors under ``model.language_model.``, beside a
  vision tower (``model.visual.``) and a multi-token-prediction head (``mtp.``), which are not
  loaded (the loader says so in one line).

The mixers are Qwen3-Next's (:mod:`~metrale_cli.models.qwen3_next`, whose config reading and
build this module calls): Gated DeltaNet where ``layer_types`` says ``linear_attention`` (else
every ``full_attention_interval``-th layer, 4 by default, is full attention), gated full
attention with QK-norm and partial RoPE (0.25 by default), the zero-centred RMSNorm (1 + weight),
the plain-weight gated norm, A_log / dt_bias: Qwen3_5GatedDeltaNet, Qwen3_5Attention and
Qwen3_5RMSNorm are Qwen3-Next's classes in transformers' modular source. What differs:

- GDN input projection: four tensors, ``in_proj_qkv`` (rows [q; k; v], the conv's channels),
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, each head-major already (HF reshapes them per head
  with no regrouping), instead of Qwen3-Next's per-key-head interleaved ``in_proj_qkvz`` /
  ``in_proj_ba``: :data:`SPLIT` stacks them as they are.
- RoPE: ``Qwen3_5TextRotaryEmbedding`` is an interleaved multimodal RoPE over three position
  rows (temporal, height, width): the temporal row's frequencies, with those at indices 1, 4,
  7, ... (2, 5, 8, ...) below 3 * mrope_section[1] (3 * mrope_section[2]) taken from the height
  (width) row. For text, every row holds the same positions (``Qwen3_5TextModel`` expands one
  arange to all three; ``Qwen3_5Model.compute_3d_position_ids`` returns none without image or
  video grids), so the three rows' frequencies are equal and the recomposition gives back the
  temporal row unchanged: plain rotate-half RoPE over the first head_dim * partial_rotary_factor
  dims. ``mrope_section`` / ``mrope_interleaved`` change nothing for text and are not read.
- FFNs: the configs drop Qwen3-Next's FFN keys. The dense model has no experts; the MoE has no
  ``mlp_only_layers`` / ``decoder_sparse_step`` (every layer is a MoE) and no
  ``norm_topk_prob`` (its router always renormalizes the top-k): a config setting one of those
  otherwise is refused, since transformers would ignore it.
- Experts as in Qwen2-MoE: per-expert tensors on disk, stacked (E, 2I, H) in memory (no
  transposed layout as in Qwen3-VL-MoE).
"""

from __future__ import annotations

import torch

from metrale_cli.config import ConfigReader, ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.layers.spec import FfnSpec, GdnSpec
from metrale_cli.models import decoder, qwen3_next, qwen_moe
from metrale_cli.models.family import BuildParts, Family
from metrale_cli.models.model import CausalLM

LANGUAGE_MODEL = "model.language_model."  # a vision-language checkpoint's text model
UNUSED = (("model.visual.", "vision tower"), ("mtp.", "multi-token-prediction head"))
# Keys Qwen3_5MoeTextConfig deletes, at the values its layers fix.
MOE_FIXED = {"mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True}
_PROJECTIONS = ("qkv", "z", "b", "a")


def _split_shapes(g: GdnSpec, a: str, h: int) -> dict[str, tuple[int, ...]]:
    rows = (g.conv_dim, g.value_dim, g.num_v_heads, g.num_v_heads)
    return {a + f"in_proj_{x}.weight": (n, h) for x, n in zip(_PROJECTIONS, rows)}


def _split_rows(g: GdnSpec, a: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    return decoder.fused_rows([t.pop(a + f"in_proj_{x}.weight") for x in _PROJECTIONS])


SPLIT = qwen3_next.GdnInProj(_split_shapes, _split_rows)


def _dense_ffns(r: ConfigReader, layers: int) -> list[FfnSpec]:
    return [FfnSpec("swiglu", r.positive_int("intermediate_size"))] * layers


def _moe_ffns(r: ConfigReader, layers: int) -> list[FfnSpec]:
    for key, value in MOE_FIXED.items():
        r.refuse(key, (value,), f"Qwen3.5-MoE has no {key} (transformers ignores it): every layer is a MoE "
                 "whose router renormalizes its top-k")
    return qwen_moe.ffn_specs(ConfigReader(r.raw | MOE_FIXED), layers, shared_expert=True)


def _config(model_type: str, ffn_specs, text_type: str | None):
    def read(r: ConfigReader) -> ModelConfig:
        text = r.text_config(tie_default=False, model_type=text_type) if text_type else r
        return qwen3_next.hybrid_config(text, model_type, ffn_specs)

    return read


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model is built from (the text names), with its shape (experts stacked)."""
    return qwen3_next.expected_tensors(cfg, SPLIT)


def canonical(cfg: ModelConfig, tensors: dict) -> None:
    """A checkpoint's tensors under the text names, in place: a vision-language checkpoint's
    ``model.language_model.X`` as ``model.X`` (transformers' qwen3_5_text conversion), what the
    loader read of the vision tower dropped, then Qwen3-Next's (MTP head dropped, experts stacked)."""
    for name in [n for n in tensors if n.startswith(UNUSED[0][0])]:
        del tensors[name]
    for name in [n for n in tensors if n.startswith(LANGUAGE_MODEL)]:
        text_name = "model." + name.removeprefix(LANGUAGE_MODEL)
        if text_name in tensors:
            raise MetraleError(f"checkpoint holds both {name} and {text_name}",
                               hint="it mixes the vision-language and the text-only names of one tensor")
        tensors[text_name] = tensors.pop(name)
    qwen3_next.canonical(cfg, tensors)


def build(cfg: ModelConfig, tensors: dict[str, torch.Tensor], parts: BuildParts) -> CausalLM:
    """The layer stack from HF-named ``tensors`` (consumed), text-only or vision-language names."""
    canonical(cfg, tensors)
    return qwen3_next.build_layers(cfg, tensors, parts, SPLIT)


def _family(model_type: str, hf_class: str, ffn_specs, text_type: str | None = None) -> Family:
    """``text_type``: a vision-language family's text model type (its config nested under ``text_config``)."""
    return Family(model_type, hf_class, _config(model_type, ffn_specs, text_type), expected_tensors, build, None,
                  canonical, UNUSED)


QWEN3_5_TEXT = _family("qwen3_5_text", "Qwen3_5ForCausalLM", _dense_ffns)
QWEN3_5_MOE_TEXT = _family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", _moe_ffns)
QWEN3_5 = _family("qwen3_5", "Qwen3_5ForConditionalGeneration", _dense_ffns, text_type="qwen3_5_text")
QWEN3_5_MOE = _family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", _moe_ffns, text_type="qwen3_5_moe_text")
