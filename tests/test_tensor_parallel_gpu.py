"""Tensor-parallel ranks on the cuda backend, on one GPU: two ranks in spawned processes share
cuda:0, their all-reduces and the LM head's gather staged through the host (gloo), so each rank
runs the cuda kernels at its shard's shapes (half the heads, one KV head, half of every expert's
width and of the shared expert's, one of two GDN key heads, half the vocabulary) on batch 1's
fused row path: rank 0 alone adds the residual in the fused projections, then the sum over the
ranks. No CUDA graph there: a host-staged sum cannot be captured (with NCCL on two GPUs the step is
one graph a rank; no machine with two GPUs has run that yet). With ``--all-reduce one-shot`` the
sums and the LM head's gather are kernels over buffers the two processes map from each other
(kernels_cu/all_reduce.cu), so there each rank's decode step is one captured graph, held to the
same ranks run eagerly.

The oracle is the same two ranks on the torch backend with its references of the fused launches
(the cuda backend's wiring, in bf16): the same shards, and the same roundings of the ranks' parts
before they are summed. Two bf16 paths, compared as the one-process GPU tests compare the cuda
and torch backends (check_logprobs_close). One process is not the oracle: the ranks round their
parts before the sum, and on the Qwen3-Next-shaped model, whose next-token logits are flat, the
references' own tokens at two ranks fall up to 0.75 below one process's best logit on five of 24
steps, where the cuda ranks' tokens were the same tokens (an H100, 2026-12-07).
"""

from __future__ import annotations

import pytest
import torch

import tp_ranks
from hf_oracle import check_logprobs_close
from metrale_cli.commands.bench_presets import random_weights
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


def _top(records: list[dict]) -> torch.Tensor:
    """Logprob records -> (steps, vocab) with each step's five likeliest tokens at their
    log-probabilities and -inf elsewhere (enough for check_logprobs_close's top-5)."""
    out = torch.full((len(records), max(t for r in records for t, _ in r["top"]) + 1), float("-inf"))
    for i, r in enumerate(records):
        for t, v in r["top"]:
            out[i, t] = v
    return out


def _check_close(ids, records, ref_ids, ref_records) -> None:
    """check_logprobs_close over two runs' logprob records (their top-5 tables padded alike)."""
    top, ref_top = _top(records), _top(ref_records)
    width = max(top.shape[1], ref_top.shape[1])
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]), value=float("-inf"))  # noqa: E731
    check_logprobs_close(ids, pad(top), ref_ids, pad(ref_top))


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_decode_on_the_cuda_kernels_as_on_their_references(case):
    raw = CASES[case]
    weights = _weights(raw)
    prompt = torch.randint(0, raw["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ids, lp, path = tp_ranks.on_one_gpu(2, tp_ranks.greedy_row_path, raw, weights, prompt, NEW, "cuda", "bf16")
    ref_ids, ref_lp, ref_path = tp_ranks.on_one_gpu(2, tp_ranks.greedy_row_path, raw, weights, prompt, NEW,
                                                    "torch", "bf16")
    assert all(path) and all(ref_path) and len(path) == raw["num_hidden_layers"] and len(ids) == NEW
    _check_close(ids, lp, ref_ids, ref_lp)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_replay_their_decode_steps_as_graphs_with_one_shot_sums_inside(case):
    """Each rank's decode steps replay one captured graph whose sums and logits gather are the
    one-shot kernels; the tokens and log-probabilities are those of the same ranks run eagerly
    with host-staged sums (both sum the two bf16 parts in fp32 and round once)."""
    raw = CASES[case]
    weights = _weights(raw)
    prompt = torch.randint(0, raw["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(2)).tolist()
    ids, lp, buckets = tp_ranks.on_one_gpu(2, tp_ranks.greedy_graphed, raw, weights, prompt, NEW)
    ref_ids, ref_lp, path = tp_ranks.on_one_gpu(2, tp_ranks.greedy_row_path, raw, weights, prompt, NEW, "cuda",
                                                "bf16")
    assert buckets == [1] and all(path) and len(ids) == NEW
    _check_close(ids, lp, ref_ids, ref_lp)
