"""The torch backend against HF transformers on tiny random Llama / Mistral / Phi-3 / Qwen2 / Qwen3 models.

Tolerances (one table, a reason per row):
- bf16 logits: our bf16 stack vs HF in fp32 may differ by at most 1.5x what HF's own bf16 path
  differs from its fp32 path (plus 0.05): both are bf16 roundings of the same math, in a
  different order.
- fp8 KV logits: NMSE vs HF fp32 <= 5e-2: e4m3 keeps 3 mantissa bits (about 2.6% RMS relative
  error per stored K/V element), amplified by three random (chaotic, init 0.2) layers.
- greedy tokens vs HF bf16: vLLM's check_logprobs_close. Two bf16 paths may part at a near-tie
  (random tiny models have flat distributions: ties within one bf16 ulp of the logit are common);
  up to that point tokens must be equal, and there each side's token is in the other's top-5.
"""

from __future__ import annotations

import pytest
import torch

from hf_oracle import (as_dtype, check_logprobs_close, hf_greedy, hf_kv_rounded_to_bf16, hf_logits,
                       make_hf, ours, planned, random_ids, teacher_forced)
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.engine.sequence import Sequence
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.models import build_model

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("mistral", {"head_dim": 24, "sliding_window": None}),  # Nemo's head_dim != hidden / heads
    "phi3": ("phi3", {"partial_rotary_factor": 0.5}),  # fused q/k/v and gate/up; RoPE on half of each head
    "phi3-tied": ("phi3", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # head_dim != hidden / heads
    "qwen3-yarn": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 128}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case):
    family, overrides = CASES[case]
    hf, raw = make_hf(family, **overrides)
    ids = random_ids(150)
    ref32 = hf_logits(hf, ids)
    noise_floor = (hf_logits(as_dtype(hf, torch.bfloat16), ids) - ref32).abs().max().item()
    got = teacher_forced(ours(hf, raw), ids)
    err = (got - ref32).abs().max().item()
    assert err <= 1.5 * noise_floor + 0.05, f"{case}: max |logit err| {err:.3f}, HF bf16 floor {noise_floor:.3f}"


@pytest.mark.parametrize("case", ["llama", "mistral", "phi3", "qwen2", "qwen3", "llama-tied"])
def test_greedy_matches_hf(case):
    family, overrides = CASES[case]
    hf, raw = make_hf(family, **overrides)
    hf16 = as_dtype(hf, torch.bfloat16)
    prompt = random_ids(24, seed=2)
    ref_ids, ref_logits = hf_greedy(hf16, prompt, 40)
    engine = ours(hf, raw, chunk=10)
    seqs, _ = engine.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))
    got_ids = seqs[0].output_ids
    assert len(got_ids) == 40
    got_logits = teacher_forced(engine, prompt + got_ids)[len(prompt) - 1 : -1]
    check_logprobs_close(got_ids, got_logits, ref_ids, ref_logits)


@pytest.mark.parametrize("case", ["llama", "mistral", "phi3", "phi3-tied", "qwen2", "qwen3", "qwen3-yarn"])
def test_greedy_equal_for_32_tokens(case):
    """fp32 activations on both sides and HF's K/V rounded to bf16 as our cache stores them: what
    is left is fp32 summation order, far below the logit margins, so the tokens are equal."""
    family, overrides = CASES[case]
    hf, raw = make_hf(family, **overrides)
    prompt = random_ids(20, seed=3)
    with hf_kv_rounded_to_bf16():
        ref_ids, _ = hf_greedy(hf, prompt, 32)
    engine = ours(hf, raw, dtype=torch.float32, chunk=9)
    seqs, _ = engine.generate([prompt], SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert seqs[0].output_ids == ref_ids


def _nmse(a, b) -> float:
    return ((a - b).pow(2).sum() / b.pow(2).sum()).item()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("calibration", [0, 256])
def test_fp8_kv_within_budget(family, calibration):
    hf, raw = make_hf(family)
    ids = random_ids(100)
    engine = ours(hf, raw, kv=KvCacheDtype.FP8, calibration=calibration)
    got = teacher_forced(engine, ids)
    assert _nmse(got, hf_logits(hf, ids)) <= 5e-2
    scales = torch.cat([pool.scale for pool in engine.model.kv_cache.pools()])
    if calibration:
        assert engine.model.calibration.fp8.source == "calibration"
        assert (scales != 1.0).all() and (scales > 0).all()
    else:
        assert engine.model.calibration.fp8.source == "default"
        assert (scales == 1.0).all()


def test_fp8_kv_scales_from_checkpoint():
    hf, raw = make_hf("llama")
    tensors_scale = {f"model.layers.{i}.self_attn.{s}_scale": torch.tensor(0.01 * (i + 1))
                     for i in range(3) for s in "kv"}
    tensors = {k: v.detach().to(torch.bfloat16).clone() for k, v in hf.state_dict().items()} | tensors_scale
    model = build_model(planned(raw, KvCacheDtype.FP8), tensors, TorchOps(), 16, 512, 256, torch.device("cpu"))
    assert model.calibration.fp8.source == "checkpoint"
    assert [round(float(kv.v.scale), 4) for kv in model.kv_cache.layers] == [0.01, 0.02, 0.03]


def test_chunked_prefill_equals_whole():
    hf, raw = make_hf("qwen3", head_dim=32)
    ids = random_ids(90)
    whole = teacher_forced(ours(hf, raw, chunk=512), ids)
    chunked_engine = ours(hf, raw, chunk=7)
    seqs, _ = chunked_engine.generate([ids], SamplingParams(max_new_tokens=16, ignore_eos=True))
    seqs_whole, _ = ours(hf, raw, chunk=512).generate([ids], SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert seqs[0].output_ids == seqs_whole[0].output_ids
    # the last-token logits of a 7-token-chunked prefill equal the one-shot prefill's exactly
    seq_logits = chunked_engine.prefill(Sequence(0, ids, 1))
    assert torch.equal(seq_logits[0], whole[-1])


def test_batch_equals_each_alone():
    hf, raw = make_hf("qwen2")
    ids = random_ids(60)
    prompts = [ids[:20], ids[30:45], ids[5:50], ids[:3]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    alone = [ours(hf, raw).generate([p], params)[0][0].output_ids for p in prompts]
    batch = [s.output_ids for s in ours(hf, raw).generate(prompts, params)[0]]
    assert batch == alone


class _FusedReferences(TorchOps):
    """The torch references with the fused batch-1 GEMVs switched on: the layer and LM-head wiring
    the cuda backend runs (CudaOps.gemv_fits), on the CPU, with counted calls."""

    def __init__(self):
        self.calls = {"gemv_norm": 0, "gemv_norm_logits": 0, "gemv_norm_swiglu": 0, "gemv_add": 0}

    @staticmethod
    def gemv_fits(k: int, dtype: torch.dtype) -> bool:
        return k % 8 == 0 and dtype == torch.bfloat16

    def __getattribute__(self, name):
        calls = object.__getattribute__(self, "calls")
        if name in calls:
            calls[name] += 1
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_batch1_decode_equals_the_unfused_path(family):
    """Norm + q/k/v, o_proj + residual, norm + gate/up + SwiGLU, down + residual and norm + LM
    head, the layers handing on their sum alone: the same greedy tokens as the unfused sequence."""
    hf, raw = make_hf(family)
    with torch.no_grad():  # norm weights other than HF's ones, so that each norm is told apart
        for name, weight in hf.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    ids, params = random_ids(40, seed=3), SamplingParams(max_new_tokens=24, ignore_eos=True)
    fused_ops = _FusedReferences()
    fused = ours(hf, raw, ops=fused_ops).generate([ids], params)[0][0].output_ids
    assert fused == ours(hf, raw).generate([ids], params)[0][0].output_ids
    # the first token comes from the prefill, the other 23 from decode steps (none launched past the
    # last: the pipelined loop knows the step in flight ends the sequence by length)
    layers, steps = raw["num_hidden_layers"], 23
    assert fused_ops.calls == {"gemv_norm": layers * steps, "gemv_norm_logits": steps + 1,
                               "gemv_norm_swiglu": layers * steps, "gemv_add": 2 * layers * steps}
