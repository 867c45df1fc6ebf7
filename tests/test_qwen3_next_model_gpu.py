"""The Qwen3-Next hybrid on the cuda backend against the torch backend, on an H200 (random weights).

Four layers, three Gated DeltaNet then gated full attention (head_dim 256, a quarter of it
rotated, GQA 4), MoE FFNs with a shared expert, the GDN heads at the real model's shape (Dk = Dv
= 128, two value heads per key head). Greedy on both backends from the same bf16 weights: decode
steps through ``Ops.gdn_decode`` and the attention kernels in CUDA graphs, prefill chunks of 37
tokens (the conv window and state carried across chunks). Two bf16 paths: tokens compared with
check_logprobs_close. Every one of the 16 KV dtypes runs on the attention layer; a batch of
ragged prompts decodes as each alone; graphs replay as eager.
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
RAW = dict(model_type="qwen3_next", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25, vocab_size=VOCAB, rms_norm_eps=1e-6,
           rope_theta=1e6, max_position_embeddings=4096, hidden_act="silu", num_experts=16, num_experts_per_tok=4,
           moe_intermediate_size=256, shared_expert_intermediate_size=512, intermediate_size=1024,
           decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
           full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
           linear_value_head_dim=128, linear_conv_kernel_dim=4)


@functools.lru_cache(maxsize=1)
def _model():
    torch.manual_seed(0)
    weights = random_weights(RAW, torch.device("cuda"), torch.bfloat16)
    for name, t in weights.items():  # routers and convs large enough to matter
        if name.endswith("mlp.gate.weight"):
            t.normal_(0.0, 0.5)
        if name.endswith("conv1d.weight"):
            t.normal_(0.0, 0.5)
    return RAW, weights


def _runner(backend: str, kv: KvCacheDtype, graphs: str = "full"):
    return loaded_runner(*_model(), backend, kv, graphs)


def _greedy(runner, prompt):
    return greedy_and_logits(runner, prompt, NEW)


@pytest.mark.parametrize("kv", list(KvCacheDtype))
def test_cuda_greedy_matches_torch(kv):
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    c_ids, c_logits = _greedy(_runner("cuda", kv), prompt)
    t_ids, t_logits = _greedy(_runner("torch", kv), prompt)
    assert len(c_ids) == NEW
    same = check_logprobs_close(c_ids, c_logits, t_ids, t_logits)
    if kv == KvCacheDtype.BF16:
        assert same >= 8, f"only {same} equal tokens on bf16 KV"


def test_cuda_decode_is_graph_captured():
    runner = _runner("cuda", KvCacheDtype.BF16)
    assert runner.engine.graphs.capture and runner.model.decode_graph_unsupported() is None


def test_cuda_batch_decode_matches_single():
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 77, 130)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    check_batch_decodes_as_alone(_runner("cuda", KvCacheDtype.BF16).engine, prompts, params)


def test_graph_replay_matches_eager():
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    e_ids, e_logits = _greedy(_runner("cuda", KvCacheDtype.BF16, graphs="disabled"), prompt)
    g_ids, g_logits = _greedy(_runner("cuda", KvCacheDtype.BF16), prompt)
    assert check_logprobs_close(g_ids, g_logits, e_ids, e_logits) >= 8
