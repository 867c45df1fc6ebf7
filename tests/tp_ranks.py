"""What one tensor-parallel rank runs in the CPU tests (``metrale_cli.engine.ranks.run_ranks`` spawns
the other ranks, which import this module by name)."""

from __future__ import annotations

import torch

from hf_oracle import greedy_and_logits
from metrale_cli.engine.runner import RunnerOptions, open_runner
from metrale_cli.engine.source import ModelSource


def greedy(tp, device, output, raw: dict, tensors: dict[str, torch.Tensor], prompt: list[int], n: int,
           chunk: int = 7):
    """n greedy tokens after ``prompt`` from HF-named ``tensors`` on the torch backend in fp32, and
    the teacher-forced logits that chose them (prefill chunks of ``chunk`` tokens, so the prompt
    takes several)."""
    opts = RunnerOptions(backend="torch", dtype="fp32", max_seq_len=128, reserve_all_memory=False,
                         prefill_chunk=chunk, kv_promote_minimum=False)
    runner = open_runner(opts, ModelSource.loaded(raw, tensors, None, raw["model_type"]), tp=tp)
    return greedy_and_logits(runner, prompt, n)


def fails_on_rank_one(tp, device, output):
    """Rank 1 fails at start-up; rank 0 goes on into a collective that rank 1 never joins."""
    from metrale_cli.errors import MetraleError

    if tp.rank == 1:
        raise MetraleError("rank one cannot start", hint="a hint for rank one")
    return float(tp.reduce(torch.ones(1)))
