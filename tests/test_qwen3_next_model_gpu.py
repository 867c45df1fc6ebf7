"""The Qwen3-Next hybrid on the cuda backend against the torch backend, on an H200 (random weights).

Four layers, three Gated DeltaNet then gated full attention (head_dim 256, a quarter of it
rotated, GQA 4), MoE FFNs with a shared expert, the GDN heads at the real model's shape (Dk = Dv
= 128, two value heads per key head). Greedy on both backends from the same bf16 weights: decode
steps through ``Ops.gdn_decode`` and the attention kernels in CUDA graphs, prefill chunks of 37
tokens (the conv window and state carried across chunks). Two bf16 paths: each cuda token held
to the torch backend's logits on the same context (_margin). Every one of the 16 KV dtypes runs on
the attention layer; a batch of ragged prompts decodes as each alone; graphs replay as eager.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_oracle import (check_batch_decodes_as_alone, check_logprobs_close, greedy_and_logits, loaded_runner,
                       teacher_forced)
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


# How far below the torch backend's best logit, on the same context (teacher-forced), each greedy
# token of the cuda decode may be. This model's next-token logits are flat (its top six often
# within 0.1 at logits near 4), so where the two bf16 paths part is a matter of single bf16 steps,
# and a rule on ranks (check_logprobs_close's top-5) or on the equal prefix would test luck:
# measured on an H200, bf16 and fp8 KV stayed within 0.016 (one bf16 step) while the cuda prefill's
# chunk arithmetic was torch's own GEMMs and solve, and bf16 reached 0.109 at the prefill's token
# once it was gdn_chunk_prep_f32 (its chunk outputs as close to an fp64 evaluation as torch's:
# 1.1e-8 to 2.8e-8 against 1.5e-8 to 7.4e-8 on this model's chunks; the 16 experts' routing turns
# a bf16 step into a different expert); the lossy dtypes' codes flip where the paths' inputs differ
# by a step (turbo2, turbo3, nvfp4, bf16k_turbo2v: 0.42 to 0.59). fp8 joined them once the cuda
# decode folded the shared expert into the routed experts' sum (one rounding fewer than the torch
# backend's HF order): each backend calibrates its fp8 scales on its own prefill, and one prompt
# of three then put a token 1.125 below (the others 0.16 and 0.06; with fixed scales, all three
# within 0.17). bf16 did the same once its head_dim 256 decode moved to tensor cores (P rounded to
# bf16 for the P V products, as at head_dim 64 and 128): of five prompts, four gave the CUDA-core
# decode's deficits step for step and one put step 14 1.06 below (0.047 before), where the torch
# backend's top two logits are 0.61 apart: a routing turned, not a tie. So bf16 keeps the tight
# margin on every step but one, and that one is held to the lossy dtypes' margin. A wrong kernel
# picks tokens several logits down, on many steps.
def _margin(kv: KvCacheDtype) -> float:
    return 0.25 if kv == KvCacheDtype.BF16 else 1.5


@pytest.mark.parametrize("kv", list(KvCacheDtype))
def test_cuda_greedy_matches_torch(kv):
    """Every one of the cuda decode's greedy tokens is within 1.5 of the torch backend's best logit
    at its step, the torch backend reading the same tokens, and all but one within _margin(kv)."""
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ids, _ = _greedy(_runner("cuda", kv), prompt)
    assert len(ids) == NEW
    logits = teacher_forced(_runner("torch", kv).engine, prompt + ids)[PROMPT_LEN - 1 : -1]
    chosen = logits.gather(1, torch.tensor(ids, device=logits.device)[:, None])[:, 0]
    deficit = logits.max(-1).values - chosen
    assert deficit.max().item() <= 1.5, f"step {int(deficit.argmax())}: {deficit.max().item():.3f} below"
    over = [(i, round(d, 3)) for i, d in enumerate(deficit.tolist()) if d > _margin(kv)]
    assert len(over) <= 1, f"steps more than {_margin(kv)} below: {over}"


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
