"""The Qwen3-MoE and Qwen2-MoE families on the torch backend against HF transformers, on tiny
random models shaped to break naive code: GQA 2 and 4, head_dim != hidden / heads, tied and
untied embeddings, dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step), expert
counts that are no power of two, top-1 and top-k, with and without renormalized weights.

Tolerances are test_models_vs_hf's (bf16 logits within 1.5x HF's own bf16-vs-fp32 difference
plus 0.05, here on the 90th percentile of positions: see test_logits_match_hf; bf16 greedy tokens by vLLM's check_logprobs_close; fp32 greedy tokens equal, HF's K/V
rounded to bf16 as our cache stores them), and KV_NMSE below for the quantized KV dtypes. HF runs
its default experts implementation (grouped_mm on CPU, each token's top-k outputs summed in
fp32); the torch reference follows HF's eager loop; in fp32 the two agree to ~1e-6.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers as T
from helpers_checkpoints import make_hf_checkpoint, write_gguf
from hf_oracle import (
    as_dtype,
    check_bf16_logits_near_hf,
    check_fp32_greedy_equals_hf,
    check_logprobs_close,
    hf_folder_greedy,
    hf_greedy,
    hf_kv_rounded_to_bf16,
    make_hf,
    ours,
    planned,
    random_ids,
    teacher_forced,
)
from safetensors.torch import load_file, save_file

import metrale_cli.api as metrale
from metrale_cli.checkpoint import gguf_cache_path
from metrale_cli.engine.generate import Engine
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.kv.dtypes import KvCacheDtype, SideType, kv_pair
from metrale_cli.layers.ffn import DenseSwiGluFfn
from metrale_cli.layers.moe import MoeFfn
from metrale_cli.layers.spec import MoeSpec, unserved
from metrale_cli.models import build_model, model_config

# case -> (family, config overrides, each layer's FFN kind); hidden 64, 4 heads, 3 layers
CASES = {
    # head_dim 32 != 64 / 4, GQA 2, 6 experts, top-2 renormalized (as Qwen3-MoE checkpoints are)
    "qwen3_moe": ("qwen3_moe", {"head_dim": 32, "num_experts": 6, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True}, ["moe", "moe", "moe"]),
    # layer 1 dense, GQA 4, tied, 12 experts, top-1 not renormalized
    "qwen3_moe-mlp-only": ("qwen3_moe", {"mlp_only_layers": [1], "num_key_value_heads": 1,
                                         "tie_word_embeddings": True, "num_experts": 12, "num_experts_per_tok": 1,
                                         "moe_intermediate_size": 48}, ["moe", "swiglu", "moe"]),
    # shared expert, 12 experts top-3 not renormalized (Qwen2-MoE's default), GQA 2
    "qwen2_moe": ("qwen2_moe", {"num_experts": 12, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48}, ["moe", "moe", "moe"]),
    # decoder_sparse_step 2: only layer 1 is MoE; GQA 4, tied, 6 experts top-4 renormalized
    "qwen2_moe-sparse-step": ("qwen2_moe", {"decoder_sparse_step": 2, "num_key_value_heads": 1,
                                            "tie_word_embeddings": True, "num_experts": 6, "num_experts_per_tok": 4,
                                            "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
                                            "norm_topk_prob": True}, ["swiglu", "moe", "swiglu"]),
}


def _hf(case: str):
    family, overrides, _ = CASES[case]
    return make_hf(family, **overrides)


@pytest.mark.parametrize("case", list(CASES))
def test_layer_specs_are_the_layers_hf_builds(case):
    hf, raw = _hf(case)
    cfg = model_config(raw)
    assert [s.ffn.kind for s in cfg.layers] == CASES[case][2]
    for spec, layer in zip(cfg.layers, hf.model.layers):
        a, attn, mlp = spec.attention, layer.self_attn, layer.mlp
        assert (a.head_dim, a.num_kv_heads, a.scale) == (attn.head_dim, raw["num_key_value_heads"], attn.scaling)
        assert (a.qkv_bias, a.o_bias, a.qk_norm) == (attn.q_proj.bias is not None, attn.o_proj.bias is not None,
                                                    hasattr(attn, "q_norm"))
        if spec.ffn.kind == "swiglu":
            assert spec.ffn.intermediate_size == mlp.intermediate_size == 128 and not hasattr(mlp, "experts")
            continue
        m, shared = spec.ffn.moe, getattr(mlp, "shared_expert", None)
        assert (m.num_experts, m.top_k, m.norm_topk_prob) == (mlp.gate.num_experts, mlp.gate.top_k,
                                                              mlp.gate.norm_topk_prob)
        assert m.expert_size == mlp.experts.intermediate_dim
        assert m.shared_expert_size == (0 if shared is None else shared.intermediate_size)
    assert unserved(cfg.layers) == []


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case):
    """The dense rule on the 90th percentile of each position's max |error|: at a near-tie of a
    router's top-k, bf16 rounding picks other experts at a few positions, and the logits there
    move by whole units (HF's own bf16 path does so too); at most 5% of positions may be further
    off than HF's bf16 path at its worst."""
    check_bf16_logits_near_hf(*_hf(case), random_ids(151))


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_in_bf16(case):
    hf, raw = _hf(case)
    prompt = random_ids(23, seed=2)
    ref_ids, ref_logits = hf_greedy(as_dtype(hf, torch.bfloat16), prompt, 40)
    engine = ours(hf, raw, chunk=10)
    got_ids = engine.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))[0][0].output_ids
    assert len(got_ids) == 40
    got_logits = teacher_forced(engine, prompt + got_ids)[len(prompt) - 1 : -1]
    check_logprobs_close(got_ids, got_logits, ref_ids, ref_logits)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equal_to_hf_for_32_tokens_in_fp32(case):
    check_fp32_greedy_equals_hf(*_hf(case), random_ids(21, seed=3), 32, chunk=9)


@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_moe-mlp-only"])
def test_batch_equals_each_alone(case):
    hf, raw = _hf(case)
    ids = random_ids(60)
    prompts = [ids[:21], ids[30:45], ids[5:50], ids[:3]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    alone = [ours(hf, raw).generate([p], params)[0][0].output_ids for p in prompts]
    assert [s.output_ids for s in ours(hf, raw).generate(prompts, params)[0]] == alone


class _FoldingReferences(TorchOps):
    """The torch references with the shared expert folded in as chunk experts, as the cuda backend
    runs it (``moe_folds_shared``), and the fused batch-1 path switched on (CudaOps.gemv_fits);
    ``rows_routed`` counts the batch-1 rows that took it."""

    moe_folds_shared = True

    def __init__(self):
        self.rows_routed = 0

    @staticmethod
    def gemv_fits(k: int, dtype: torch.dtype) -> bool:
        return k % 8 == 0 and dtype == torch.bfloat16

    def moe_norm_route(self, *args, **kwargs):
        self.rows_routed += 1
        return super().moe_norm_route(*args, **kwargs)


def _moe_ffns(engine: Engine) -> list[MoeFfn]:
    return [layer.ffn for layer in engine.model.layers if isinstance(layer.ffn, MoeFfn)]


@pytest.mark.parametrize("case, qkv_bias", [("qwen2_moe", False), ("qwen2_moe-sparse-step", True)])
def test_a_folded_shared_expert_gives_hf_tokens(case, qkv_bias):
    """The shared expert as chunk experts after the routed ones and its gate as a router row: widths
    48 and 40 over experts of 32 and 24, so two chunks, the last one zero-padded. HF's 32 greedy
    tokens in fp32 (prefill chunks and the batched decode path); in bf16 HF's within
    check_logprobs_close, without q/k/v biases through the batch-1 path (``add_row``)."""
    family, overrides, _ = CASES[case]
    hf, raw = make_hf(family, **overrides, qkv_bias=qkv_bias)
    prompt = random_ids(21, seed=3)
    with hf_kv_rounded_to_bf16():
        ref_ids, _ = hf_greedy(hf, prompt, 32)
    engine = ours(hf, raw, dtype=torch.float32, chunk=9, ops=_FoldingReferences())
    ffns = _moe_ffns(engine)
    assert ffns and [(f.shared_slots, f.folded is not None) for f in ffns] == [(2, True)] * len(ffns)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    assert engine.generate([prompt], params)[0][0].output_ids == ref_ids
    ref_ids, ref_logits = hf_greedy(as_dtype(hf, torch.bfloat16), prompt, 32)
    ops = _FoldingReferences()
    engine = ours(hf, raw, chunk=10, ops=ops)
    got_ids = engine.generate([prompt], params)[0][0].output_ids
    check_logprobs_close(got_ids, teacher_forced(engine, prompt + got_ids)[len(prompt) - 1:-1], ref_ids, ref_logits)
    assert (ops.rows_routed > 0) == (not qkv_bias)


@pytest.mark.parametrize("width, inter", [(48, 32), (64, 32), (24, 32), (96, 32)])
def test_folding_the_shared_expert_keeps_the_ffn_s_output(width, inter):
    """MoeFfn with the shared expert folded in (``width`` read as ceil(width / inter) chunks, the
    last one zero-padded) against it run apart, in fp64, on prefill rows and on the batch-1 row
    with its norm: equal but for the gate's sigmoid, which the route takes in fp32 (as HF does in
    an fp32 model); and the same bytes counted as read."""
    g = torch.Generator().manual_seed(width)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    spec, hidden = MoeSpec(6, 2, inter, False, width), 40
    weights = (rand(6, hidden), rand(6, 2 * inter, hidden) * 0.2, rand(6, hidden, inter) * 0.2, TorchOps(),
               DenseSwiGluFfn(rand(2 * width, hidden) * 0.2, rand(hidden, width) * 0.2, TorchOps()), rand(1, hidden))
    apart, folded = MoeFfn(spec, *weights), MoeFfn(spec, *weights, fold_shared=True)
    chunks = -(-width // inter)
    assert (apart.shared_slots, folded.shared_slots, apart.router.shape[0], folded.router.shape[0]) == (
        0, chunks, 6, 7)
    x, h, norm = rand(7, hidden), rand(1, hidden), rand(hidden)
    torch.testing.assert_close(folded(x), apart(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(folded.add_row(h, norm, 1e-6), apart.add_row(h, norm, 1e-6), rtol=1e-6, atol=1e-6)
    # the bytes a call reads: the routed experts it chose, and whole: the router, the shared
    # expert and its gate (folded: the router's last row)
    assert folded.routed_bytes() == apart.routed_bytes() > 0
    assert sum(t.numel() for t in folded.tensors()) == sum(t.numel() for t in apart.tensors())


@pytest.mark.parametrize("width, folded", [(48, True), (44, False)])
def test_a_backend_that_folds_takes_widths_its_kernels_read(width, folded):
    """Where the backend folds (``moe_folds_shared``), a shared width the kernels read in 8-element
    pieces is folded; another one runs apart, as on the torch backend."""
    g = torch.Generator().manual_seed(width)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    ops = _FoldingReferences()
    ffn = MoeFfn(MoeSpec(6, 2, 32, False, width), rand(6, 40), rand(6, 64, 40), rand(6, 40, 32), ops,
                 DenseSwiGluFfn(rand(2 * width, 40), rand(40, width), ops), rand(1, 40))
    assert (ffn.folded is not None, ffn.shared_slots, ffn.router.shape[0]) == (
        (True, 2, 7) if folded else (False, 0, 6))


def test_fused_and_per_expert_tensors_build_the_same_model(tmp_path):
    """HF's in-memory state dict holds each layer's experts fused; save_pretrained writes one
    tensor per expert: both build the same model, and the build pops every expert tensor."""
    hf, raw = _hf("qwen2_moe-sparse-step")
    hf.save_pretrained(tmp_path)
    per_expert = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in per_expert
    assert "model.layers.1.mlp.experts.gate_up_proj" in hf.state_dict()
    fused = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    ids = random_ids(33)
    logits = []
    for tensors in (fused, per_expert):
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
        model = build_model(planned(raw), tensors, TorchOps(), 64, 512, 0, torch.device("cpu"))
        assert not [k for k in tensors if ".experts." in k]
        logits.append(teacher_forced(Engine(model, 512), ids))
    assert torch.equal(*logits)


# --- from files, through the normal loading path ------------------------------------------------------
@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path / "cache"))


def _generate(path, n: int = 32) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of metrale's normal load of ``path`` on the torch backend, fp32."""
    llm = metrale.load(str(path), backend="torch", dtype="fp32")
    prompt = llm.encode("The quick brown fox", chat=False)
    return prompt, llm.generate("The quick brown fox", chat=False, max_new_tokens=n, ignore_eos=True).token_ids


@pytest.mark.parametrize("family, settings", [
    ("qwen3_moe", {}),
    ("qwen3_moe", {"max_shard_size": "40KB", "mlp_only_layers": [0], "tie_word_embeddings": True}),
    ("qwen2_moe", {"max_shard_size": "40KB"}),
    ("qwen2_moe", {"decoder_sparse_step": 2, "num_experts": 5, "num_experts_per_tok": 5}),
])
def test_a_saved_folder_generates_hf_tokens(tmp_path, family, settings):
    folder = make_hf_checkpoint(tmp_path, family, **settings)
    assert (len(list(folder.glob("model-*.safetensors"))) > 1) == ("max_shard_size" in settings)
    prompt, got = _generate(folder)
    assert got == hf_folder_greedy(folder, prompt, 32)


def _hf_view_of_the_conversion(gguf_path, folder):
    """An HF folder of what metrale converted the GGUF to: its cached weights and the config
    synthesized from the GGUF metadata, for HF to load."""
    cached = gguf_cache_path(gguf_path)
    shutil.copy(cached / "config.json", folder / "config.json")
    os.symlink(cached / "model.float32.safetensors", folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_a_gguf_generates_hf_tokens(tmp_path, family, quant):
    """HF runs the weights the file holds (dequantized by metrale; bit-equal to the checkpoint's
    for F32, as test_gguf checks) under the config metrale synthesized from its metadata."""
    folder = make_hf_checkpoint(tmp_path, family)
    path = write_gguf(folder, tmp_path / f"{family}.gguf", quant)
    prompt, got = _generate(path)
    (tmp_path / "view").mkdir()
    view = _hf_view_of_the_conversion(path, tmp_path / "view")
    assert got == hf_folder_greedy(view, prompt, 32)
    if quant == "F32":
        assert got == hf_folder_greedy(folder, prompt, 32)


def test_the_command_line_generates_hf_tokens_from_a_sharded_folder(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "qwen2_moe", max_shard_size="40KB", mlp_only_layers=[1])
    result = subprocess.run([sys.executable, "-m", "metrale_cli", "generate", "-m", str(folder), "--backend", "torch",
                             "--dtype", "fp32", "--no-chat-template", "-n", "24", "--ignore-eos", "--json",
                             "The quick brown fox"], capture_output=True, text=True, timeout=300, check=False,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    (only,) = json.loads(result.stdout)["results"]
    prompt = T.AutoTokenizer.from_pretrained(folder)("The quick brown fox").input_ids
    assert only["token_ids"] == hf_folder_greedy(folder, prompt, 24)


# --- every KV dtype ----------------------------------------------------------------------------------
# Logit NMSE against bf16 KV of the 3-layer random MoE model (init 0.2) with every layer in the
# dtype, by its lower-precision side: test_kv_model's dense budgets (routing moves with the
# quantization error, about 1.5-2x the dense model's NMSE, still within them), 2-bit sides twice
# the 3-bit budget.
SIDE_NMSE = {SideType.BF16: 0.0, SideType.FP8: 2e-2, SideType.TURBO8: 2e-2, SideType.NVFP4: 1.5e-1,
             SideType.TURBO4: 1.5e-1, SideType.TURBO3: 4e-1, SideType.TURBO2: 8e-1}


@pytest.fixture(scope="module")
def tiny_moe():
    return make_hf("qwen3_moe", head_dim=64, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                   norm_topk_prob=True)  # head_dim 64: the turbo sides need a WHT size


@pytest.fixture(scope="module")
def bf16_kv_logits(tiny_moe):
    return teacher_forced(ours(*tiny_moe, blocks=32), random_ids(60, seed=5))


@pytest.mark.parametrize("dtype", list(KvCacheDtype), ids=lambda d: d.value)
def test_every_kv_dtype_runs_the_moe_model(tiny_moe, bf16_kv_logits, dtype):
    engine = ours(*tiny_moe, kv=dtype, blocks=32, chunk=16)
    out = engine.generate([random_ids(40)], SamplingParams(max_new_tokens=8, ignore_eos=True))[0][0].output_ids
    assert len(out) == 8 and all(0 <= t < 384 for t in out)
    assert [kv.dtype for kv in engine.model.kv_cache.layers] == [dtype] * 3
    got = teacher_forced(ours(*tiny_moe, kv=dtype, blocks=32, chunk=16), random_ids(60, seed=5))
    assert torch.isfinite(got).all()
    nmse = ((got - bf16_kv_logits).pow(2).sum() / bf16_kv_logits.pow(2).sum()).item()
    assert nmse <= max(SIDE_NMSE[side] for side in kv_pair(dtype)), f"{dtype.value}: {nmse:.3e}"


# --- bad input: one error line naming what is wrong ----------------------------------------------------
def _rewrite(folder, edit) -> None:
    (shard,) = folder.glob("model.safetensors")
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
     "checkpoint is missing 1 tensor(s): model.layers.1.mlp.experts.3.up_proj.weight"),
    (lambda t: t.update({"model.layers.0.mlp.experts.5.down_proj.weight": torch.zeros(64, 31, dtype=torch.bfloat16)}),
     "tensor model.layers.0.mlp.experts.5.down_proj.weight has shape (64, 31), config.json implies (64, 32)"),
    (lambda t: t.update({"model.layers.0.mlp.experts.6.gate_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16)}),
     "checkpoint has 1 unexpected tensor(s): model.layers.0.mlp.experts.6.gate_proj.weight"),
    (lambda t: t.update({"model.layers.1.mlp.shared_expert_gate.weight": torch.zeros(64, dtype=torch.bfloat16)}),
     "tensor model.layers.1.mlp.shared_expert_gate.weight has shape (64,), config.json implies (1, 64)"),
    (lambda t: t.update({"model.layers.1.mlp.experts.down_proj": torch.zeros(6, 64, 32, dtype=torch.bfloat16)}),
     "checkpoint holds model.layers.1.mlp.experts.* both stacked (model.layers.1.mlp.experts.down_proj) and one "
     "tensor per expert (model.layers.1.mlp.experts.0.down_proj.weight)"),
], ids=["missing-expert", "expert-shape", "extra-expert", "shared-gate-shape", "stacked-and-per-expert"])
def test_a_broken_expert_tensor_is_one_error_line(tmp_path, edit, message):
    folder = make_hf_checkpoint(tmp_path, "qwen2_moe")
    _rewrite(folder, edit)
    with pytest.raises(MetraleError) as info:
        metrale.load(str(folder), backend="torch")
    assert info.value.message == message


def test_a_gguf_whose_experts_disagree_with_its_metadata_is_one_error_line(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "qwen3_moe")
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"moe_intermediate_size": 32', '"moe_intermediate_size": 24'))
    with pytest.raises(MetraleError) as info:
        metrale.load(str(write_gguf(folder, tmp_path / "w.gguf")), backend="torch")
    assert info.value.message == ("GGUF tensor blk.0.ffn_down_exps.weight has shape (6, 64, 32), "
                                  "expected (64, 24) for each expert")


BASE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 128, "num_experts": 6, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32}


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 7}, "config.json num_experts_per_tok (7) exceeds num_experts (6)"),
    ({"num_experts": None, "num_local_experts": 4, "num_experts_per_tok": 5},
     "config.json num_experts_per_tok (5) exceeds num_local_experts (4)"),
    ({"moe_intermediate_size": None}, "config.json has no 'moe_intermediate_size'"),
    ({"num_experts": 0}, "config.json key 'num_experts' must be a positive integer, got 0"),
    ({"num_experts": None, "num_local_experts": 0},
     "config.json key 'num_local_experts' must be a positive integer, got 0"),
    ({"decoder_sparse_step": 0}, "config.json key 'decoder_sparse_step' must be a positive integer, got 0"),
    ({"hidden_act": "gelu"}, "config.json hidden_act='gelu' is not supported"),
    ({"mlp_only_layers": "1"}, "config.json mlp_only_layers must be a list of layer indices, got '1'"),
    ({"mlp_only_layers": [1], "intermediate_size": None}, "config.json has no 'intermediate_size'"),
    ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 40,
      "layer_types": ["full_attention", "linear_attention"]},
     "config.json layer_types names 'linear_attention', not a layer type this family has"),
    ({"mlp_only_layers": [0, 2, -1]},
     "config.json mlp_only_layers lists layer(s) [2, -1] outside num_hidden_layers (2)"),
    ({"model_type": "qwen2_moe"}, "config.json has no 'shared_expert_intermediate_size'"),
    ({"norm_topk_prob": "false"}, "config.json key 'norm_topk_prob' must be true or false, got 'false'"),
    ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 40, "qkv_bias": "no"},
     "config.json key 'qkv_bias' must be true or false, got 'no'"),
    ({"rms_norm_eps": "1e-6"}, "config.json key 'rms_norm_eps' must be a number, got '1e-6'"),
    ({"rope_parameters": {"rope_theta": "1e6"}}, "config.json key 'rope_theta' must be a number, got '1e6'"),
    ({"rms_norm_eps": -1}, "config.json key 'rms_norm_eps' must be a positive number, got -1"),
    ({"rms_norm_eps": float("nan")}, "config.json key 'rms_norm_eps' must be a finite number, got nan"),
    ({"rope_theta": 0}, "config.json key 'rope_theta' must be a positive number, got 0"),
    ({"rope_parameters": {"rope_theta": -5}}, "config.json key 'rope_theta' must be a positive number, got -5"),
    ({"rope_theta": float("nan")}, "config.json key 'rope_theta' must be a finite number, got nan"),
    ({"rope_parameters": [1e6]}, "config.json rope_parameters must be an object, got [1000000.0]"),
])
def test_a_bad_moe_config_is_one_error_naming_the_key(change, message):
    with pytest.raises(MetraleError) as info:
        model_config({k: v for k, v in (BASE | change).items() if v is not None})
    assert info.value.message == message


def test_every_moe_key_is_read():
    """Qwen3-MoE as transformers 5 saves it (num_local_experts), all layers sparse without
    intermediate_size; Qwen2-MoE without qkv_bias (older hub configs) has its q/k/v biases."""
    cfg = model_config({k: v for k, v in BASE.items() if k not in ("num_experts", "intermediate_size")}
                       | {"num_local_experts": 5})
    assert [s.ffn.moe.num_experts for s in cfg.layers] == [5, 5]
    qwen2 = model_config(BASE | {"model_type": "qwen2_moe", "shared_expert_intermediate_size": 40})
    a, m = qwen2.layers[0].attention, qwen2.layers[0].ffn.moe
    assert (a.qkv_bias, a.o_bias, a.qk_norm, m.shared_expert_size, m.norm_topk_prob) == (True, False, False, 40, False)
    assert not model_config(BASE | {"model_type": "qwen2_moe", "shared_expert_intermediate_size": 40,
                                    "qkv_bias": False}).layers[0].attention.qkv_bias


@pytest.mark.parametrize("family, settings, windows", [
    ("qwen3_moe", {"max_window_layers": 1}, [64, 64, 64]),  # Qwen3MoeAttention: every layer
    ("qwen2_moe", {"max_window_layers": 2}, [64, None, None]),  # the even layers below max_window_layers
    ("qwen2_moe", {"max_window_layers": 28}, [64, None, 64]),
])
def test_a_sliding_window_is_refused_on_the_layers_hf_gives_it(family, settings, windows):
    hf, raw = make_hf(family, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, use_sliding_window=True, sliding_window=64, **settings)
    assert [getattr(layer.self_attn, "sliding_window", None) for layer in hf.model.layers] == windows
    assert [s.attention.sliding_window for s in model_config(raw).layers] == windows
    raw.pop("layer_types", None)  # older hub configs: the family's default rule
    assert [s.attention.sliding_window for s in model_config(raw).layers] == windows
    assert "sliding_window = 64: no attention kernel applies a sliding window" in unserved(model_config(raw).layers)[0]
