"""Decode steps from static device buffers, replayed as CUDA graphs, one per batch-size bucket.

An eager decode step of a 28-36 layer model issues several hundred kernel launches from Python;
replaying a captured graph issues one. Every input of the step lives in a static device buffer
(tokens, positions, cache slots, block tables, context lengths, a live-row mask) that is filled
from the host when the batch changes, so one graph per bucket serves every later step and every
sequence. Rows past the live batch are padding: slot -1 (nothing written), context length 1,
block 0.

Between steps the buffers move on by themselves: :meth:`advance` writes the sampled tokens in
as the next inputs and moves every live row's position, context length and cache slot on by
one, on the device (``Ops.decode_advance``: one kernel on the cuda backend, captured as a second
small graph). Greedy decoding takes its tokens in the same launch (:meth:`advance_greedy`). The
engine can so launch step t + 1 before it has read step t's tokens on the host: the host work of
a step (sampling launch, the token round-trip, stop checks, streaming) overlaps the GPU's work on
the next one.

Without ``capture`` (a backend whose attention cannot be captured, ``--cuda-graph-mode
disabled``, or the CPU) the same buffers drive an eager forward, so every backend runs the one
decode loop.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from metrale_cli.kernels.ops import StepBuffers
from metrale_cli.layers.context import ForwardContext
from metrale_cli.models.model import CausalLM

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model: CausalLM, max_batch: int, max_blocks: int, capture: bool = True):
        dev = model.device
        self.model = model
        self.capture = capture and dev.type == "cuda"
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        b = max_batch
        self.step = StepBuffers.zeros(b, max_blocks, dev)
        pool = model.ssm_pool
        self.scratch_slot = None if pool is None else pool.scratch
        # each row's slot of a hybrid's recurrent-state pool (the scratch slot for padding)
        self.ssm_slots = None if pool is None else torch.full((b,), pool.scratch, dtype=torch.int32, device=dev)
        self._host = np.zeros((b, 5 + max_blocks), dtype=np.int64)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.advance_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # by (bucket, greedy)
        self.logits: torch.Tensor | None = None  # the last forward's (bucket, vocab) logits
        self.states: list[list] = []  # the filled rows' layer states
        self.pool = None
        self.capture_seconds = 0.0  # host time spent capturing graphs so far (decode speed leaves it out)

    def _timed(self, capture):
        """Run ``capture``, adding its host time to ``capture_seconds``; the device's queue is
        drained first, so that the steps before are not counted as capture."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        start = time.perf_counter()
        try:
            return capture()
        finally:
            self.capture_seconds += time.perf_counter() - start

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def graphed(self) -> bool:
        """Whether steps replay graphs now: online calibration (fp8 scales, InnerQ) must have
        frozen, or a captured graph would replay its scale writes on every step."""
        return self.capture and self.model.kv_frozen

    # --- the step -------------------------------------------------------------------------
    def run(self, tokens: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
            states: list[list] | None = None) -> torch.Tensor:
        """Fill the buffers for n sequences and run one step -> (n, vocab) float32 logits."""
        self.fill(tokens, positions, slots, block_tables, states)
        return self.forward(len(tokens))

    def fill(self, tokens, positions, slots, block_tables, states: list[list] | None = None) -> None:
        """Load one step's inputs from the host (one copy); rows past them become padding.
        ``states``: each sequence's layer states (a captured graph replays without them: a layer
        whose state is host-side says so in ``decode_graph_unsupported``); a hybrid's rows' pool
        slots go to the ``ssm_slots`` buffer."""
        n = len(tokens)
        self.states = list(states or [[] for _ in range(n)])
        b = self.bucket(n)
        host = self._host[:b]
        host[:] = 0
        host[:n, 0], host[:n, 1], host[:n, 2], host[:n, 3] = tokens, positions, slots, 1
        host[n:, 2] = -1
        if self.ssm_slots is not None:
            host[:, 4] = self.scratch_slot
            for i, seq_states in enumerate(self.states):
                slot = self.model.ssm_slot(seq_states)
                host[i, 4] = self.scratch_slot if slot is None else slot
        for i, table in enumerate(block_tables):
            host[i, 5 : 5 + len(table)] = table
        staged = torch.from_numpy(host).to(self.model.device, non_blocking=False)
        self.step.tokens[:b].copy_(staged[:, 0])
        self.step.positions[:b].copy_(staged[:, 1])
        self.step.slots[:b].copy_(staged[:, 2])
        self.step.live[:b].copy_(staged[:, 3])
        self.step.seq_lens[:b].copy_(staged[:, 1] + 1)
        self.step.tables[:b].copy_(staged[:, 5:])
        if self.ssm_slots is not None:
            self.ssm_slots[:b].copy_(staged[:, 4])

    def forward(self, n: int) -> torch.Tensor:
        """One step over the buffers' first n rows -> (n, vocab) float32 logits."""
        b = self.bucket(n)
        if not self.graphed():
            self.logits = self.model.forward(*self._args(b))
            return self.logits[:n]
        if b not in self.graphs:
            self.graphs[b] = self._timed(lambda: self._capture(b))
        graph, self.logits = self.graphs[b]
        graph.replay()
        return self.logits[:n]

    def advance(self, n: int, next_tokens: torch.Tensor) -> None:
        """Make the sampled tokens (n,) the next step's inputs and move the live rows on by one
        position (context length, cache slot from the block table), all on the device."""
        self.step.next_tokens[:n].copy_(next_tokens)
        self._step(self.bucket(n), greedy=False)

    def advance_greedy(self, n: int) -> torch.Tensor:
        """:meth:`advance` with every row's greedy token of the last :meth:`forward`, taken on the
        device in the same launch -> the first n rows' tokens (a view of ``next_tokens``, valid
        until the next step's advance)."""
        self._step(self.bucket(n), greedy=True)
        return self.step.next_tokens[:n]

    def _step(self, b: int, greedy: bool) -> None:
        if not self.graphed():
            self._advance(b, greedy)
            return
        if (b, greedy) not in self.advance_graphs:
            self.advance_graphs[b, greedy] = self._timed(lambda: self._capture_advance(b, greedy))
        self.advance_graphs[b, greedy].replay()

    # --- internals ------------------------------------------------------------------------
    def _args(self, b: int):
        padding = [[] for _ in range(b - len(self.states))]
        ctx = ForwardContext("decode", self.step.positions[:b], self.step.slots[:b],
                             block_tables=self.step.tables[:b], seq_lens=self.step.seq_lens[:b],
                             states=self.states[:b] + padding,
                             ssm_slots=None if self.ssm_slots is None else self.ssm_slots[:b])
        return self.step.tokens[:b], ctx, None  # every row's logits

    def _advance(self, b: int, greedy: bool) -> None:
        """The bucket's b rows move on; ``greedy``: from the tokens of the last forward's logits
        (b rows: a padding row's token is never used)."""
        self.model.ops.decode_advance(self.logits if greedy else None, self.step, b)

    def _warm(self, fn) -> None:
        """Run once on a side stream (lazy kernel loads, allocator growth) before a capture."""
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        args = self._args(b)
        pool = self.model.ssm_pool
        saved = None if pool is None else pool.save(self.ssm_slots[:b])
        self._warm(lambda: self.model.forward(*args))
        if saved is not None:  # the warm-up stepped the rows' recurrent states: undo it (a KV write is idempotent)
            pool.restore(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(*args)
        self.pool = graph.pool()
        return graph, logits

    def _capture_advance(self, b: int, greedy: bool) -> torch.cuda.CUDAGraph:
        moved = (self.step.next_tokens, self.step.tokens, self.step.positions, self.step.seq_lens, self.step.slots)
        saved = [t.clone() for t in moved]
        self._warm(lambda: self._advance(b, greedy))
        for buf, old in zip(moved, saved):
            buf.copy_(old)  # the warm-up moved the live rows on: undo it
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._advance(b, greedy)
        self.pool = graph.pool()
        return graph
