"""MoE models on the cuda backend against the torch backend, on an H200 (random weights).

A Qwen3-MoE of 4 layers (32 experts, 4 active, layer 1 dense among the MoE ones, GQA 4, head_dim
64) and a Qwen2-MoE with a shared expert run greedy on both backends from the same bf16 weights:
the decode steps on moe.cu's launches in CUDA graphs (batch 1 through the fused attention
GEMVs and the MoE component's own row path), the prefill chunks of 37 tokens and more on the
grouped GEMMs. Two bf16 paths: tokens compared with check_logprobs_close. Every one of the 16 KV
dtypes runs the Qwen3-MoE this way, and a batch of ragged prompts decodes as each alone.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_oracle import check_batch_decodes_as_alone, check_logprobs_close, greedy_and_logits, loaded_runner
from metrale_cli.commands.bench_presets import random_weights
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.kv.dtypes import KvCacheDtype

pytestmark = pytest.mark.gpu

VOCAB, PROMPT_LEN, NEW = 4096, 100, 32
_COMMON = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
               vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
               hidden_act="silu", num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
               intermediate_size=1024, decoder_sparse_step=1)
MODELS = {
    "qwen3_moe": dict(_COMMON, model_type="qwen3_moe", head_dim=64, norm_topk_prob=True, mlp_only_layers=[1],
                      tie_word_embeddings=False),
    "qwen2_moe": dict(_COMMON, model_type="qwen2_moe", norm_topk_prob=False, mlp_only_layers=[],
                      shared_expert_intermediate_size=768, tie_word_embeddings=True),
}


@functools.lru_cache(maxsize=1)
def _model(name: str):
    raw = MODELS[name]
    torch.manual_seed(0)
    weights = random_weights(raw, torch.device("cuda"), torch.bfloat16)
    # Router weights large enough that the choice is not a near-tie everywhere.
    for tensor_name, t in weights.items():
        if tensor_name.endswith("mlp.gate.weight"):
            t.normal_(0.0, 0.5)
    return raw, weights


def _runner(model, backend: str, kv: KvCacheDtype, graphs: str = "full"):
    return loaded_runner(*model, backend, kv, graphs)


def _greedy(runner, prompt):
    return greedy_and_logits(runner, prompt, NEW)


# Every KV dtype on the Qwen3-MoE; the Qwen2-MoE's shared expert on bf16 and fp8 KV.
GREEDY = [("qwen3_moe", kv) for kv in KvCacheDtype] + [("qwen2_moe", KvCacheDtype.BF16), ("qwen2_moe", KvCacheDtype.FP8)]


@pytest.mark.parametrize("name, kv", GREEDY)
def test_cuda_greedy_matches_torch(name, kv):
    model = _model(name)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    c_ids, c_logits = _greedy(_runner(model, "cuda", kv), prompt)
    t_ids, t_logits = _greedy(_runner(model, "torch", kv), prompt)
    assert len(c_ids) == NEW
    same = check_logprobs_close(c_ids, c_logits, t_ids, t_logits)
    if kv == KvCacheDtype.BF16:
        assert same >= 8, f"only {same} equal tokens on bf16 KV"


@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_batch_decode_matches_single(name):
    model = _model(name)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 77, 130)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    check_batch_decodes_as_alone(_runner(model, "cuda", KvCacheDtype.BF16).engine, prompts, params)


@pytest.mark.parametrize("name", list(MODELS))
def test_graph_replay_matches_eager(name):
    model = _model(name)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    e_ids, e_logits = _greedy(_runner(model, "cuda", KvCacheDtype.BF16, graphs="disabled"), prompt)
    g_ids, g_logits = _greedy(_runner(model, "cuda", KvCacheDtype.BF16), prompt)
    assert check_logprobs_close(g_ids, g_logits, e_ids, e_logits) >= 8
