"""CUDA-graph replay of the whole decode step, one graph per batch-size bucket.

An eager decode step of a 28-36 layer model issues several hundred kernel launches from Python;
replaying a captured graph issues one. Every input of the step lives in a static device buffer
(tokens, positions, cache slots, block tables, context lengths) that the engine fills before
each replay, so one graph per bucket serves every later step and every sequence. Rows past the
live batch are padding: slot -1 (nothing written), context length 1, block 0.
"""

from __future__ import annotations

import numpy as np
import torch

from metrale_cli.layers.context import ForwardContext
from metrale_cli.models.model import CausalLM

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model: CausalLM, max_batch: int, max_blocks: int):
        dev = model.device
        self.model = model
        self.max_blocks = max_blocks
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        b = max_batch
        self.tokens = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int32, device=dev)
        self.slots = torch.full((b,), -1, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.rows = torch.arange(b, device=dev)
        self._host = np.zeros((b, 3 + max_blocks), dtype=np.int64)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, tokens: list[int], positions: list[int], slots: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """One decode step for n sequences -> (n, vocab) float32 logits."""
        n = len(tokens)
        b = self.bucket(n)
        self._fill(tokens, positions, slots, block_tables, b)
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:n]

    def _fill(self, tokens, positions, slots, block_tables, b: int) -> None:
        host, n = self._host[:b], len(tokens)
        host[:] = 0
        host[:n, 0], host[:n, 1], host[:n, 2] = tokens, positions, slots
        host[n:, 2] = -1
        for i, table in enumerate(block_tables):
            host[i, 3 : 3 + len(table)] = table
        staged = torch.from_numpy(host).to(self.model.device, non_blocking=False)
        self.tokens[:b].copy_(staged[:, 0])
        self.positions[:b].copy_(staged[:, 1])
        self.slots[:b].copy_(staged[:, 2])
        self.seq_lens[:b].copy_(staged[:, 1] + 1)
        self.tables[:b].copy_(staged[:, 3:])

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ctx = ForwardContext("decode", self.positions[:b], self.slots[:b],
                             block_tables=self.tables[:b], seq_lens=self.seq_lens[:b])
        args = (self.tokens[:b], ctx, self.rows[:b])
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: lazy loads, allocator growth
            self.model.forward(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(*args)
        self.pool = graph.pool()
        return graph, logits
