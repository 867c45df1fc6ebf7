"""Tensor parallelism: N processes, one device each, one torch.distributed group (NCCL on GPUs,
gloo on the CPU), each holding a shard of every layer.

What a rank holds (Megatron-style, as vLLM and SGLang shard these families):

- attention: its ``num_heads / N`` query heads and their KV heads (``num_kv_heads / N``; where N
  exceeds the KV heads, the one KV head its query heads read, replicated), so its paged KV cache
  holds those heads only; q/k/v are column-parallel, o_proj row-parallel (its bias on rank 0);
- dense FFNs and shared experts: ``intermediate_size / N`` of gate/up (column-parallel) and of
  down (row-parallel);
- MoE experts: tensor-parallel, every expert's width split ``expert_size / N`` (every rank routes
  every token the same way: the router is replicated);
- Gated DeltaNet: its ``num_k_heads / N`` key heads and their value heads (in_proj, the conv's
  channels, A_log and dt_bias; out_proj row-parallel);
- embedding and LM head: vocab-parallel, ``ceil(vocab / N)`` rows each (the last rank's padded
  with zero rows), the LM head's logits gathered on every rank.

Each row-parallel output is summed over the ranks by one all-reduce (:meth:`TensorParallel.reduce`:
the group's, NCCL on GPUs, or with ``--all-reduce one-shot`` a one-shot kernel for what fits its
buffers, ``kernels/cuda_collectives.py``) before the residual add; where the residual add is fused into the projection (batch 1's GEMVs and
MoE row path), rank 0 alone adds the residual (:meth:`TensorParallel.addend`) and the all-reduce
follows the fused launch. Every rank then holds the same hidden state and the same logits, so every
rank samples the same tokens and runs the same engine loop (SPMD); rank 0 alone owns the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group: ``rank`` of ``size``; ``group`` None for one process."""

    rank: int = 0
    size: int = 1
    group: object = None
    one_shot: object = None  # kernels.cuda_collectives.OneShot: the small sums and gathers, else the group's

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (an all-reduce, in place); ``x`` itself for one process."""
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.sums(x):
                return self.one_shot.sum_(x)
            self._group_sum(x)
        return x

    def _group_sum(self, x: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)

    def addend(self, residual: torch.Tensor | None) -> torch.Tensor | None:
        """What this rank adds to its part of a row-parallel sum that :meth:`reduce` completes:
        ``residual`` on rank 0, None on the others, so the sum over the ranks holds it once."""
        return residual if self.rank == 0 else None

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, rank 0's first."""
        if self.size == 1:
            return x
        if self.one_shot is not None and self.one_shot.gathers(x):
            return self.one_shot.gather_columns(x)
        return self._group_gather(x)

    def _group_gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def vocab_rows(self, vocab: int) -> int:
        """Embedding / LM-head rows a rank holds."""
        return math.ceil(vocab / self.size)


SINGLE = TensorParallel()
