"""Tensor-parallel ranks on the cuda backend, on one GPU: two ranks in spawned processes share
cuda:0, their all-reduces and the LM head's gather staged through the host (gloo), so each rank
runs the cuda kernels at its shard's shapes (half the heads, one KV head, half of every expert's
width and of the shared expert's, one of two GDN key heads, half the vocabulary) with batch 1's
fused row path: rank 0 alone adds the residual in the fused projections, then the sum over the
ranks. No CUDA graph: a host-staged sum cannot be captured (with NCCL on two GPUs the step is one
graph a rank; no machine with two GPUs has run that yet).

Two bf16 paths (the ranks' parts are rounded before they are summed): each greedy token of the
two ranks is held to the torch backend's logits on the same context in one process (as
test_qwen3_next_model_gpu.py holds the cuda decode), all within 1.5 of the best and all but one
within 0.25. With the residual added on every rank, or no sum after a fused projection, the ranks'
tokens fall several logits down (the same checks in fp32 on the CPU: test_tensor_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

import tp_ranks
from hf_oracle import loaded_runner, teacher_forced
from metrale_cli.commands.bench_presets import random_weights
from metrale_cli.kv.dtypes import KvCacheDtype
from test_moe_model_gpu import MODELS
from test_qwen3_next_model_gpu import RAW as NEXT

pytestmark = pytest.mark.gpu

PROMPT_LEN, NEW = 100, 24
CASES = {"qwen3_moe": MODELS["qwen3_moe"], "qwen3_next": NEXT}


def _weights(raw: dict) -> dict[str, torch.Tensor]:
    """bf16 weights on the host (each rank moves them to the GPU); routers and convs large enough
    to matter, as in the one-process GPU tests."""
    weights = random_weights(raw, torch.device("cpu"), torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for name, t in weights.items():
        if name.endswith("mlp.gate.weight") or name.endswith("conv1d.weight"):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
    return weights


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_on_the_fused_row_path_decode_as_one_process(case):
    raw = CASES[case]
    weights = _weights(raw)
    prompt = torch.randint(0, raw["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ids, path = tp_ranks.on_one_gpu(2, tp_ranks.greedy_cuda, raw, weights, prompt, NEW)
    assert all(path) and len(path) == raw["num_hidden_layers"] and len(ids) == NEW
    cuda_weights = {name: t.cuda() for name, t in weights.items()}
    logits = teacher_forced(loaded_runner(raw, cuda_weights, "torch", KvCacheDtype.BF16).engine,
                            prompt + ids)[PROMPT_LEN - 1 : -1]
    chosen = logits.gather(1, torch.tensor(ids)[:, None])[:, 0]
    deficit = logits.max(-1).values - chosen
    assert deficit.max().item() <= 1.5, f"step {int(deficit.argmax())}: {deficit.max().item():.3f} below"
    over = [(i, round(d, 3)) for i, d in enumerate(deficit.tolist()) if d > 0.25]
    assert len(over) <= 1, f"steps more than 0.25 below: {over}"
