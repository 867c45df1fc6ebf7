"""The Qwen3.5 hybrids on the torch backend against HF transformers, on tiny random models: the
dense and the MoE text models (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) and the published
vision-language form (Qwen3_5[Moe]ForConditionalGeneration: text under ``text_config`` and
``model.language_model.``, a vision tower and an MTP head beside it, not loaded).

Tolerances are test_qwen3_next_vs_hf's: fp32 greedy tokens equal to HF's (HF's K/V rounded to
bf16 as our cache stores them), bf16 by check_logprobs_close and the logits-percentile rule.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from helpers_checkpoints import SPECIAL_TOKENS, _randomize, make_tokenizer
from hf_oracle import (
    check_batch_decodes_as_alone,
    check_bf16_greedy_near_hf,
    check_bf16_logits_near_hf,
    check_chunked_prefill,
    check_fp32_greedy_equals_hf,
    hf_greedy,
    hf_kv_rounded_to_bf16,
    hf_logits,
    make_hf,
    ours,
    random_ids,
    teacher_forced,
)
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

import metrale_cli.api as metrale
from metrale_cli.checkpoint import load_checkpoint
from metrale_cli.commands.bench_presets import DESCRIPTIONS, PRESETS
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.layers.rope import rope_tables
from metrale_cli.layers.spec import unserved
from metrale_cli.models import family_of, model_config

MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# case -> (family, config overrides, each layer's mixer); hidden 64, 4 heads, head_dim != 64 / 4
CASES = {
    # attention first and in the middle (layer_types), GQA 2, a quarter of head_dim 32 rotated,
    # two value heads per key head, tied embeddings
    "dense": ("qwen3_5_text", {"num_hidden_layers": 5, "head_dim": 32, "tie_word_embeddings": True,
                               "layer_types": ["full_attention", "linear_attention", "linear_attention",
                                               "full_attention", "linear_attention"],
                               "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                               "linear_value_head_dim": 8},
              ["attention", "gdn", "gdn", "attention", "gdn"]),
    # full_attention_interval 4 (no layer_types), GQA 4, rotary 0.5 of head_dim 48, three value
    # heads per key head, untied, a MoE with a shared expert on every layer
    "moe": ("qwen3_5_moe_text", {"num_hidden_layers": 4, "head_dim": 48, "num_key_value_heads": 1,
                                 "partial_rotary_factor": 0.5, "linear_num_key_heads": 1,
                                 "linear_num_value_heads": 3, "linear_key_head_dim": 16, "linear_value_head_dim": 16}
            | MOE, ["gdn", "gdn", "gdn", "attention"]),
}


def _perturb_norms(model, seed: int) -> None:
    """Zero-centred norms start at 0 and the gated norm at 1: move them all."""
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))


def _hf(case: str, seed: int = 0):
    family, overrides, _ = CASES[case]
    hf, raw = make_hf(family, seed=seed, **overrides)
    _perturb_norms(hf, seed)
    return hf, raw


# --- the config -------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_layer_specs_are_the_layers_hf_builds(case):
    hf, raw = _hf(case)
    cfg = model_config(raw)
    assert [s.mixer for s in cfg.layers] == CASES[case][2] == [
        {"linear_attention": "gdn", "full_attention": "attention"}[t] for t in hf.config.layer_types]
    for spec, layer in zip(cfg.layers, hf.model.layers):
        mlp = layer.mlp
        if spec.ffn.moe is None:
            assert spec.ffn.kind == "swiglu" and spec.ffn.intermediate_size == mlp.intermediate_size
        else:
            m = spec.ffn.moe
            assert (m.num_experts, m.top_k, m.expert_size, m.shared_expert_size, m.norm_topk_prob) == (
                mlp.experts.num_experts, mlp.gate.top_k, mlp.experts.intermediate_dim,
                mlp.shared_expert.intermediate_size, True)
        if spec.mixer == "gdn":
            g, lin = spec.gdn, layer.linear_attn
            assert (g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim, g.conv_kernel) == (
                lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim, lin.conv_kernel_size)
            continue
        a, attn = spec.attention, layer.self_attn
        assert (a.head_dim, a.num_kv_heads, a.scale, a.output_gate, a.qk_norm) == (
            attn.head_dim, raw["num_key_value_heads"], attn.scaling, True, True)
        assert a.head_dim * a.num_heads != raw["hidden_size"]
        assert int(a.head_dim * a.rope.partial_rotary_factor) == 2 * hf.model.rotary_emb.inv_freq.shape[0] < a.head_dim
    assert cfg.tie_word_embeddings == (hf.lm_head.weight is hf.model.embed_tokens.weight)
    assert unserved(cfg.layers) == []


def test_text_positions_make_the_interleaved_mrope_plain_rope():
    """HF's Qwen3_5TextRotaryEmbedding given the same positions on its three rows (what a text
    prompt gets) is the rotate-half RoPE our tables hold; different rows would not be."""
    hf, raw = _hf("dense")
    mrope = raw | {"rope_parameters": raw["rope_parameters"] | {"mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    rotary = hf_qwen3_5.Qwen3_5TextRotaryEmbedding(T.Qwen3_5TextConfig.from_dict(mrope))
    spec = model_config(raw).layers[0].attention
    cos, sin = rope_tables(spec.rope, spec.head_dim, 40, 512, torch.device("cpu"))
    x, positions = torch.zeros(1, 40, 64), torch.arange(40)
    hf_cos, hf_sin = rotary(x, positions.view(1, 1, -1).expand(3, 1, -1))
    half = hf_cos.shape[-1] // 2
    assert half == cos.shape[1] == 4 and torch.equal(hf_cos[0, :, :half], hf_cos[0, :, half:])
    assert torch.allclose(hf_cos[0, :, :half], cos, atol=1e-6) and torch.allclose(hf_sin[0, :, :half], sin, atol=1e-6)
    moved = torch.stack([positions, positions + 7, positions])  # the height row elsewhere
    assert not torch.allclose(rotary(x, moved.view(3, 1, -1))[0][0, :, :half], cos, atol=1e-3)


def test_defaults_follow_transformers_configs():
    """No layer_types: every 4th layer attends; no partial_rotary_factor: a quarter rotates; a
    vision-language config ties its LM head by its own tie_word_embeddings (False when absent),
    whatever text_config says, as Qwen3_5ForConditionalGeneration does."""
    text = {k: v for k, v in BASE.items() if k != "model_type" and k not in MOE} | {"num_hidden_layers": 8}
    cfg = model_config({"model_type": "qwen3_5_text", **text})
    hf_cfg = T.Qwen3_5TextConfig(**text)
    assert [s.mixer == "attention" for s in cfg.layers] == [t == "full_attention" for t in hf_cfg.layer_types]
    assert cfg.layers[3].attention.rope.partial_rotary_factor == hf_cfg.rope_parameters["partial_rotary_factor"] == 0.25
    for top, inner in ((None, True), (True, False), (False, True)):
        outer = {} if top is None else {"tie_word_embeddings": top}
        raw = {"model_type": "qwen3_5", **outer, "text_config": text | {"tie_word_embeddings": inner}}
        vl = T.Qwen3_5ForConditionalGeneration(T.Qwen3_5Config(**outer, text_config=raw["text_config"],
                                                               vision_config=VISION))
        assert model_config(raw).tie_word_embeddings == (vl.lm_head.weight is vl.model.language_model.embed_tokens.weight)
    assert model_config({"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text}).tie_word_embeddings


# --- the model against HF -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equal_to_hf_for_40_tokens_in_fp32(case):
    check_fp32_greedy_equals_hf(*_hf(case), random_ids(21, seed=3), 40, chunk=9)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_logits_match_hf(case):
    hf, raw = _hf(case)
    check_bf16_logits_near_hf(hf, raw, random_ids(101))


@pytest.mark.parametrize("seed", [2, 3])
def test_greedy_matches_hf_in_bf16(seed):
    """On the dense case: a random MoE hybrid is all router near-ties in bf16 (there HF's own
    bf16 tokens leave its fp32 ones)."""
    check_bf16_greedy_near_hf(*_hf("dense"), random_ids(19, seed=seed), 32, chunk=10)


def test_chunked_prefill_equals_one_prefill_and_hfs_logits():
    """Prefill chunks of 7 carry each GDN layer's conv window and state into the next chunk. HF's
    K/V rounded to bf16 round either way of an fp32 ulp: against its fp64 path (K/V rounded too),
    HF's own fp32 logits are 7e-4 off here, ours 1.2e-3."""
    check_chunked_prefill(*_hf("moe"), random_ids(61, seed=4), chunk=7, hf_tolerance=3e-3)


@pytest.mark.parametrize("case", list(CASES))
def test_batch_decodes_as_each_alone_and_states_go_back(case):
    hf, raw = _hf(case)
    ids = random_ids(60)
    engine = ours(hf, raw)
    check_batch_decodes_as_alone(engine, [ids[:21], ids[30:45], ids[5:50], ids[:3]],
                                 SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert engine.model.free_state_slots() == 8


# --- the vision-language checkpoints ------------------------------------------------------------------
TEXT = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
VL = {"qwen3_5": (T.Qwen3_5Config, T.Qwen3_5ForConditionalGeneration, "dense", False),
      "qwen3_5_moe": (T.Qwen3_5MoeConfig, T.Qwen3_5MoeForConditionalGeneration, "moe", True)}


def _vl_folder(tmp_path, model_type: str):
    """A tiny random vision-language checkpoint (bf16 safetensors + tokenizer) whose text model is
    the case's, with two multi-token-prediction tensors added as the hub's checkpoints carry them."""
    from safetensors.torch import load_file, save_file

    config_cls, model_cls, case, tie = VL[model_type]
    folder = tmp_path / model_type
    folder.mkdir()
    tokenizer = make_tokenizer(folder)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    family, overrides, _ = CASES[case]
    text = T.AutoConfig.for_model(family, **(TEXT | overrides), vocab_size=len(tokenizer), max_position_embeddings=256,
                                  eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]).to_dict()
    torch.manual_seed(0)
    model = model_cls(config_cls(text_config=text, vision_config=VISION, tie_word_embeddings=tie)).to(torch.bfloat16)
    _randomize(model, 0)
    model.save_pretrained(folder)
    (shard,) = folder.glob("model.safetensors")
    extra = {"mtp.fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16),
             "mtp.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}
    save_file(load_file(str(shard)) | extra, str(shard), metadata={"format": "pt"})
    return folder, model_cls


def _unread(folder, prefix: str, what: str) -> str:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        sizes = [f.get_slice(n).get_shape() for n in f.keys() if n.startswith(prefix)]
    mib = sum(2 * torch.Size(s).numel() for s in sizes) / 2**20  # bf16
    return f"the {what} ({prefix}*: {len(sizes)} tensors, {mib:.1f} MiB)"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("model_type", list(VL))
def test_a_vision_language_checkpoint_runs_its_text_model_as_hf_does(tmp_path, model_type):
    folder, model_cls = _vl_folder(tmp_path, model_type)
    llm = metrale.load(str(folder), backend="torch", dtype="fp32", max_num_seqs=2)
    assert llm.runner.config.family == model_type
    assert llm.runner.source == (f"{folder.name} (safetensors, {folder}; not loaded: "
                                 f"{_unread(folder, 'model.visual.', 'vision tower')}, "
                                 f"{_unread(folder, 'mtp.', 'multi-token-prediction head')})")
    prompt = llm.encode("The quick brown fox", chat=False)
    got = llm.generate("The quick brown fox", chat=False, max_new_tokens=32, ignore_eos=True).token_ids
    hf = model_cls.from_pretrained(folder, dtype=torch.float32).eval()
    with hf_kv_rounded_to_bf16():
        assert got == hf_greedy(hf, prompt, 32)[0]
    loaded = load_checkpoint(str(folder), torch.device("cpu"), torch.float32).tensors  # what was read
    assert not [n for n in loaded if n.startswith(("model.visual.", "mtp."))]
    assert {n.removeprefix("model.language_model.") for n in loaded} >= {"embed_tokens.weight", "norm.weight"}


def test_a_vision_language_state_dict_builds_the_text_model():
    """HF's in-memory names (model.language_model.*, model.visual.*, experts stacked) from the
    Python API: the same logits as HF's ForConditionalGeneration, text only."""
    config_cls, model_cls, case, _ = VL["qwen3_5_moe"]
    torch.manual_seed(1)
    text = T.AutoConfig.for_model(CASES[case][0], **(TEXT | CASES[case][1]), vocab_size=384,
                                  initializer_range=0.2).to_dict()
    hf = model_cls(config_cls(text_config=text, vision_config=VISION)).eval()
    _perturb_norms(hf, 1)
    ids = random_ids(33, seed=6)
    with hf_kv_rounded_to_bf16():
        want = hf_logits(hf, ids)
    got = teacher_forced(ours(hf, hf.config.to_dict(), dtype=torch.float32), ids)
    assert (got - want).abs().max() < 1e-3


class _FusedGemvs(TorchOps):
    """The torch references with the batch-1 GEMVs switched on (the cuda backend's wiring), on the
    CPU, counting the o_proj rows that come with their output gate."""

    def __init__(self):
        self.gated = 0

    @staticmethod
    def gemv_fits(k: int, dtype: torch.dtype) -> bool:
        return k % 8 == 0 and dtype == torch.bfloat16

    def gemv_add(self, x, weight, residual, gate=None):
        self.gated += gate is not None
        return TorchOps.gemv_add(x, weight, residual, gate)


def test_batch1_fused_decode_gates_o_projs_row_as_the_unfused_path():
    """A gated attention at batch 1: o_proj's GEMV takes the attention's row with its gate (the
    sigmoid and the product inside it) and decodes the greedy tokens of the unfused sequence."""
    hf, raw = _hf("dense")
    ids, params = random_ids(40, seed=5), SamplingParams(max_new_tokens=16, ignore_eos=True)
    ops = _FusedGemvs()
    fused = ours(hf, raw, ops=ops).generate([ids], params)[0][0].output_ids
    assert fused == ours(hf, raw).generate([ids], params)[0][0].output_ids
    assert ops.gated == 2 * 15  # two attention layers a step, 15 decode steps (the first token is the prefill's)


# --- refused configs ---------------------------------------------------------------------------------
BASE = {"model_type": "qwen3_5_moe_text", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, **MOE}
WHY = " (transformers ignores it): every layer is a MoE whose router renormalizes its top-k"


@pytest.mark.parametrize("change, message, hint", [
    ({"mlp_only_layers": [1]}, "config.json mlp_only_layers=[1] is not supported",
     "Qwen3.5-MoE has no mlp_only_layers" + WHY),
    ({"decoder_sparse_step": 2}, "config.json decoder_sparse_step=2 is not supported",
     "Qwen3.5-MoE has no decoder_sparse_step" + WHY),
    ({"norm_topk_prob": False}, "config.json norm_topk_prob=False is not supported",
     "Qwen3.5-MoE has no norm_topk_prob" + WHY),
    ({"shared_expert_intermediate_size": None}, "config.json has no 'shared_expert_intermediate_size'",
     "is this a complete HF checkpoint?"),
    ({"model_type": "qwen3_5_text", "intermediate_size": None}, "config.json has no 'intermediate_size'",
     "is this a complete HF checkpoint?"),
    ({"linear_num_value_heads": 3}, ("config.json linear_num_value_heads (3) is not a multiple of "
                                     "linear_num_key_heads (2)"), None),
    ({"attention_bias": True}, "config.json attention_bias=True is not supported",
     "the hybrids' gated attention is built without q/k/v/o biases"),
    ({"partial_rotary_factor": 0.1}, ("config.json partial_rotary_factor 0.1 rotates 3.2 of 32 dims; it must "
                                      "rotate an even number of them"), None),
    ({"model_type": "qwen3_5"}, "config.json has no 'text_config'", "is this a complete HF checkpoint?"),
    ({"model_type": "qwen3_5_moe", "text_config": [1]}, "config.json text_config must be an object, got [1]", None),
    ({"model_type": "qwen3_5", "text_config": BASE}, "config.json text_config has model_type 'qwen3_5_moe_text', "
     "not 'qwen3_5_text'", "a qwen3_5 checkpoint's text model is qwen3_5_text"),
    ({"model_type": "qwen3_5_moe", "text_config": BASE | {"model_type": "llama"}},
     "config.json text_config has model_type 'llama', not 'qwen3_5_moe_text'",
     "a qwen3_5_moe checkpoint's text model is qwen3_5_moe_text"),
])
def test_a_bad_config_is_one_error_naming_the_key(change, message, hint):
    with pytest.raises(MetraleError) as info:
        model_config({k: v for k, v in (BASE | change).items() if v is not None})
    assert (info.value.message, info.value.hint) == (message, hint)


def test_a_vision_language_config_is_read_from_its_text_config():
    text = {k: v for k, v in BASE.items() if k != "model_type"}
    nested = model_config({"model_type": "qwen3_5_moe", "vision_config": {"depth": 27}, "text_config": text})
    assert nested.layers == model_config(BASE).layers and nested.family == "qwen3_5_moe"
    assert model_config({"model_type": "qwen3_5_moe", "text_config": BASE}).layers == nested.layers  # its own type
    with pytest.raises(MetraleError) as info:
        model_config({"model_type": "qwen3_5_moe", "text_config": text | {"norm_topk_prob": False}})
    assert info.value.message == "config.json norm_topk_prob=False is not supported"


def test_a_tensor_under_both_names_is_one_error():
    cfg = model_config({"model_type": "qwen3_5_moe", "text_config": BASE})
    norm = torch.ones(64)
    with pytest.raises(MetraleError) as info:
        family_of("qwen3_5_moe").canonical(cfg, {"model.language_model.norm.weight": norm, "model.norm.weight": norm})
    assert info.value.message == "checkpoint holds both model.language_model.norm.weight and model.norm.weight"


# --- bench presets at the published shapes ----------------------------------------------------------
def _gigabytes(raw: dict) -> float:
    cfg = model_config(raw)
    return round(sum(2 * torch.Size(s).numel() for s in family_of(cfg.family).expected_tensors(cfg).values()) / 1e9, 1)


def test_the_hybrid_presets_hold_the_bytes_their_descriptions_say():
    """bf16 weights of the random-weight presets (never allocated here): Qwen3.5-27B's text model,
    and Qwen3-Next-80B-A3B cut to the most layers (a multiple of 4) leaving 20 GB of an H200's 141."""
    q35, cut = PRESETS["qwen3.5-27b"], PRESETS["qwen3-next-80b-a3b-36l"]
    hf_cfg = T.Qwen3_5TextConfig(**{k: v for k, v in q35.items() if k != "model_type"})
    assert [s.mixer == "attention" for s in model_config(q35).layers] == [
        t == "full_attention" for t in hf_cfg.layer_types]
    assert _gigabytes(q35) == 53.8 and "53.8 GB" in DESCRIPTIONS["qwen3.5-27b"]
    whole = {layers: _gigabytes(cut | {"num_hidden_layers": layers}) for layers in (36, 40, 48)}
    assert whole == {36: 119.8, 40: 133.0, 48: 159.3} and 141 - whole[36] >= 20 > 141 - whole[40]
    assert [s.mixer for s in model_config(cut).layers] == ["gdn", "gdn", "gdn", "attention"] * 9
    assert "cut to 36 of its 48 layers" in DESCRIPTIONS["qwen3-next-80b-a3b-36l"]
