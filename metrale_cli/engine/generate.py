"""The generation loop: chunked prefill per sequence, then batched decode of every running one.

Sequences are admitted while the pool can reserve their whole budget
(prompt + max_new_tokens, capped by max_seq_len) and, in a hybrid, a slot of the recurrent-state
pool is free, so a running sequence never meets an exhausted pool; the rest wait for blocks and
slots to be released. A sequence that could never fit is an
error up front. Each admitted sequence gets its layers' states (``Layer.alloc_state``), released
with its blocks when it ends. :meth:`Engine.stream` yields the text as it is decoded;
:meth:`Engine.generate` runs the same loop to the end.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from metrale_cli.engine.cuda_graphs import DecodeGraphs
from metrale_cli.engine.sampler import Sampler, SamplingParams
from metrale_cli.engine.sequence import Sequence, StopText
from metrale_cli.errors import MetraleError
from metrale_cli.kv.paged import blocks_for
from metrale_cli.kv.pool import BLOCK_SIZE
from metrale_cli.layers.context import ForwardContext
from metrale_cli.models.model import CausalLM

TextCallback = Callable[[int, str], None]
TextDelta = tuple[int, str]  # (prompt index, newly decoded text)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0  # decode steps only: CUDA graph capture is left out
    capture_seconds: float = 0.0  # capturing the decode step's CUDA graphs, during this run

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def check_prompt_lengths(prompts: list[list[int]], max_seq_len: int, vocab_size: int) -> None:
    """Every prompt has a token, only tokens of the model's vocabulary (a tokenizer with tokens
    added past it would index past the embedding), and leaves room for one generated token in
    the context."""
    for i, ids in enumerate(prompts):
        if not ids:
            raise MetraleError(f"prompt {i + 1} has no tokens", hint="give the model some text")
        if max(ids) >= vocab_size:
            raise MetraleError(f"prompt {i + 1}: token id {max(ids)} is past the model's vocabulary of {vocab_size} "
                               "tokens: the tokenizer does not match the checkpoint",
                               hint="use the tokenizer files that came with the checkpoint")
        if len(ids) >= max_seq_len:
            raise MetraleError(
                f"prompt {i + 1} has {len(ids)} tokens; the context is {max_seq_len} tokens (--max-seq-len)",
                hint="shorten the prompt or raise --max-seq-len",
            )


@dataclass
class InFlight:
    """A launched decode step whose sampled tokens are on their way to the host."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # (n,) int64 on the host (pinned on a GPU), valid once `ready` is set
    ready: torch.cuda.Event | None = None
    logprobs: torch.Tensor | None = None  # Sampler.logprobs_of's rows, on the device

    def collect(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tokens.tolist()

    def collect_logprobs(self) -> list[dict | None]:
        """Each row's log-probabilities as a record (None without them); reading them waits for
        the device (only a run that asks for logprobs pays that)."""
        if self.logprobs is None:
            return [None] * len(self.seqs)
        return [logprob_record(row) for row in self.logprobs.cpu().tolist()]


def logprob_record(row: list[float]) -> dict:
    """A Sampler.logprobs_of row -> {"logprob": ..., "top": [[token id, logprob], ...]}; a NaN or
    infinite one (the logits were not finite) is an error, not a figure printed as true."""
    n = (len(row) - 1) // 2
    if not all(math.isfinite(v) for v in row[: 1 + n]):
        raise MetraleError("the model's logits are not finite (NaN or inf): its log-probabilities are not numbers",
                           hint="activations overflowed or the weights are corrupt; with --dtype fp16, try bf16")
    return {"logprob": row[0], "top": [[int(t), v] for v, t in zip(row[1 : 1 + n], row[1 + n :])]}


class Engine:
    def __init__(self, model: CausalLM, max_seq_len: int, prefill_chunk: int = 512,
                 graphs: DecodeGraphs | None = None, max_batch: int = 8):
        """``graphs``: the static-buffer decode step (captured or eager); by default an eager one
        for up to ``max_batch`` sequences. Larger batches decode eagerly from host state."""
        self.model = model
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.device = model.device
        self.graphs = graphs or DecodeGraphs(model, max_batch, blocks_for(max_seq_len), capture=False)
        self._ring, self._ring_at = None, 0

    # --- model steps ----------------------------------------------------------------------
    def _int32(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _slots(self, block_table: list[int], positions: range, write_from: int) -> list[int]:
        return [block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE if p >= write_from else -1
                for p in positions]

    def prefill(self, seq: Sequence, kv_write_start: int = 0, every_position: bool = False) -> torch.Tensor:
        """Run every token of the sequence not yet in the cache; returns the last token's logits
        (1, V) float32, or with ``every_position`` every token's (T, V)."""
        ids = seq.prompt_ids + seq.output_ids
        self.model.kv_cache.ensure_capacity(seq.block_table, len(ids))
        if not seq.states:  # a sequence's first prefill allocates its layers' states
            seq.states = self.model.alloc_states()
        table = self._int32(seq.block_table)
        logits = []
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = ids[start : start + self.prefill_chunk]
            positions = range(start, start + len(chunk))
            ctx = ForwardContext(
                kind="prefill", positions=self._int32(list(positions)),
                slot_mapping=self._int32(self._slots(seq.block_table, positions, kv_write_start)),
                start_pos=start, block_table=table, states=[seq.states],
            )
            tokens = torch.tensor(chunk, dtype=torch.long, device=self.device)
            rows = torch.arange(len(chunk), device=self.device) if every_position else \
                torch.tensor([len(chunk) - 1], device=self.device)
            logits.append(self.model.forward(tokens, ctx, rows))
        return torch.cat(logits) if every_position else logits[-1]

    def teacher_forced(self, ids: list[int]) -> torch.Tensor:
        """The logits after every token of ``ids`` in one chunked prefill of a fresh sequence:
        (len(ids), V) float32; the sequence is released after."""
        seq = Sequence(0, list(ids), 1)
        try:
            return self.prefill(seq, every_position=True)
        finally:
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Give a sequence's blocks and layer states back (the loop does this when one ends)."""
        self.model.kv_cache.release(seq.block_table)
        self.model.release_states(seq.states)

    def _inputs(self, seqs: list[Sequence]):
        """Each sequence's last token, its position and cache slot, from the host state."""
        for s in seqs:
            self.model.kv_cache.ensure_capacity(s.block_table, s.length)
        positions = [s.length - 1 for s in seqs]
        slots = [self._slots(s.block_table, range(p, p + 1), 0)[0] for s, p in zip(seqs, positions)]
        return [s.output_ids[-1] for s in seqs], positions, slots

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One step for every sequence: feeds each one's last token; returns (B, V) logits."""
        tokens, positions, slots = self._inputs(seqs)
        if self._fed(len(seqs)):
            return self.graphs.run(tokens, positions, slots, [s.block_table for s in seqs], [s.states for s in seqs])
        width = max(len(s.block_table) for s in seqs)
        ctx = ForwardContext(
            kind="decode", positions=self._int32(positions), slot_mapping=self._int32(slots),
            block_tables=self._int32([s.block_table + [0] * (width - len(s.block_table)) for s in seqs]),
            seq_lens=self._int32([s.length for s in seqs]), states=[s.states for s in seqs],
        )
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.model.forward(ids, ctx, None)  # every sequence's logits

    def _fed(self, batch: int) -> bool:
        """Whether a step of this batch runs from the static buffers (then the next step's inputs
        are advanced on the device and the host may read tokens a step late)."""
        return self.graphs.bucket(batch) is not None

    def launch(self, seqs: list[Sequence], sampler: Sampler, refill: bool) -> InFlight:
        """Launch one decode step for every sequence and the sampling of its tokens; returns
        without waiting for them. ``refill``: load the inputs from the sequences' host state;
        else the static buffers already hold them (advanced on the device by the last step,
        whose tokens the host need not have read yet)."""
        n = len(seqs)
        if self._fed(n):
            if refill:
                self.graphs.fill(*self._inputs(seqs), [s.block_table for s in seqs], [s.states for s in seqs])
            logits = self.graphs.forward(n)
            if sampler.params.greedy and not sampler.params.penalized:
                tokens = self.graphs.advance_greedy(n)
            else:
                tokens = sampler(logits, [s.index for s in seqs])
                self.graphs.advance(n, tokens)
        else:
            logits = self.decode(seqs)
            tokens = sampler(logits, [s.index for s in seqs])
        return InFlight(seqs, *self._to_host(tokens), sampler.logprobs_of(logits, tokens))

    def decode_steps(self, seqs: list[Sequence], steps: int, sampler: Sampler) -> None:
        """``steps`` decode steps of every sequence without stop checks (bench), each sampled
        token appended to its sequence; pipelined as :meth:`generate` runs them."""
        flight, refill = None, True
        for _ in range(steps):
            if flight is not None and refill:
                self._append(flight)
                flight = None
            launched = self.launch(seqs, sampler, refill)
            refill = not self._fed(len(seqs))
            if flight is not None:
                self._append(flight)
            flight = launched
        if flight is not None:
            self._append(flight)

    @staticmethod
    def _append(flight: InFlight) -> None:
        for seq, token in zip(flight.seqs, flight.collect()):
            seq.output_ids.append(token)

    def _to_host(self, tokens: torch.Tensor):
        if self.device.type != "cuda":
            return tokens.clone(), None
        n = tokens.shape[0]
        if self._ring is None or self._ring[0].shape[0] < n:
            size = max([n, *self.graphs.buckets])
            self._ring = [torch.empty(size, dtype=torch.long, pin_memory=True) for _ in range(2)]
        buf = self._ring[self._ring_at][:n]
        self._ring_at ^= 1  # two steps are in flight at most: the one launched, the one read
        buf.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return buf, ready

    # --- the loop -------------------------------------------------------------------------
    def _budget(self, seq: Sequence) -> int:
        return blocks_for(min(len(seq.prompt_ids) + seq.max_new_tokens, self.max_seq_len))

    def _check_fits(self, seqs: list[Sequence]) -> None:
        pool = self.model.kv_cache.num_blocks
        check_prompt_lengths([s.prompt_ids for s in seqs], self.max_seq_len, self.model.cfg.vocab_size)
        for s in seqs:
            if self._budget(s) > pool:
                raise MetraleError(
                    f"KV cache pool exhausted: prompt {s.index + 1} needs {self._budget(s)} blocks "
                    f"of {BLOCK_SIZE} tokens, the pool has {pool}",
                    hint="raise --gpu-memory-utilization or lower --max-seq-len / --max-new-tokens",
                )

    def _accept(self, seq: Sequence, token: int, params: SamplingParams, eos: set[int]) -> str:
        """Append a token; returns the text it makes safe to show."""
        seq.output_ids.append(token)
        delta = seq.text.push(token) if seq.text is not None else ""
        if token in eos and not params.ignore_eos:
            seq.finish_reason = "eos"
        elif seq.text is not None and seq.text.stopped:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= seq.max_new_tokens:
            seq.finish_reason = "length"
        elif seq.length >= self.max_seq_len:
            seq.finish_reason = "context"
        return delta

    def generate(self, prompts: list[list[int]], params: SamplingParams, eos_ids=(), tokenizer=None,
                 on_text: TextCallback | None = None) -> tuple[list[Sequence], GenerationStats]:
        """Generate for every prompt (token ids); text is tracked when a tokenizer is given and
        handed to ``on_text(prompt index, delta)`` as it is decoded."""
        run = self.stream(prompts, params, eos_ids, tokenizer)
        while True:
            try:
                index, delta = next(run)
            except StopIteration as done:
                return done.value
            if on_text is not None:
                on_text(index, delta)

    def stream(self, prompts: list[list[int]], params: SamplingParams, eos_ids=(),
               tokenizer=None) -> Generator[TextDelta, None, tuple[list[Sequence], GenerationStats]]:
        """:meth:`generate` as a generator: yields (prompt index, text) as it is decoded (held back
        where it could still become a stop string) and returns (sequences, stats)."""
        seqs = [Sequence(i, list(p), params.max_new_tokens) for i, p in enumerate(prompts)]
        if tokenizer is not None:
            for s in seqs:
                s.text = StopText(tokenizer.stream_decoder(), params.stop)
        self._check_fits(seqs)
        sampler, eos, stats = Sampler(params, self.device), set(eos_ids), GenerationStats()
        try:
            return (yield from self._loop(seqs, params, sampler, eos, stats))
        finally:  # also when the caller stops reading: every block and state goes back
            for seq in seqs:
                if seq.block_table or seq.states:
                    self.release(seq)

    def _loop(self, seqs: list[Sequence], params: SamplingParams, sampler: Sampler, eos: set[int],
              stats: GenerationStats):
        waiting, running = list(seqs), []
        cache = self.model.kv_cache
        flight, refill, started = None, True, self._now()
        captured = self.graphs.capture_seconds
        while waiting or running or flight:
            if flight is not None and refill:  # the host must catch up before the batch changes
                yield from self._accept_all(flight, params, eos, stats)
                flight = None
            running = yield from self._retire(running)
            while flight is None and self._admissible(waiting):
                seq = waiting.pop(0)
                cache.ensure_capacity(seq.block_table, self._budget(seq) * BLOCK_SIZE)
                t0 = self._now()
                logits = self.prefill(seq)
                sampler.start(seq.index, seq.prompt_ids, logits.shape[-1])
                first = sampler(logits, [seq.index])
                lp = sampler.logprobs_of(logits, first)
                if lp is not None:
                    seq.logprobs.append(logprob_record(lp[0].tolist()))
                delta = self._accept(seq, int(first[0]), params, eos)
                stats.prompt_tokens += len(seq.prompt_ids)
                stats.prompt_seconds += self._now() - t0
                if delta:
                    yield seq.index, delta
                running.append(seq)
                refill = True
            running = yield from self._retire(running)
            launched = None
            if running and not self._all_end_in(flight, running):
                launched = self.launch(running, sampler, refill)
                refill = not self._fed(len(running))  # an eager step reads host state: catch up first
            if flight is not None:
                yield from self._accept_all(flight, params, eos, stats)
                if any(s.done for s in flight.seqs) or self._admissible(waiting):
                    refill = True
            flight = launched
        stats.capture_seconds = self.graphs.capture_seconds - captured
        stats.decode_seconds = self._now() - started - stats.prompt_seconds - stats.capture_seconds
        return seqs, stats

    def _all_end_in(self, flight: InFlight | None, running: list[Sequence]) -> bool:
        """Whether the step in flight brings every running sequence to its last token (by length or
        context): then no step is launched behind it, whose tokens would all be dropped."""
        if flight is None:
            return False
        pending = {id(s) for s in flight.seqs}
        return all(id(s) in pending and (len(s.output_ids) + 1 >= s.max_new_tokens
                                         or s.length + 1 >= self.max_seq_len) for s in running)

    def _accept_all(self, flight: InFlight, params, eos, stats: GenerationStats):
        """Read a step's tokens; a sequence that finished while the step was in flight drops its
        token (the step ran one position past its end, inside its reserved blocks)."""
        for seq, token, lp in zip(flight.seqs, flight.collect(), flight.collect_logprobs()):
            if not seq.done:
                if lp is not None:
                    seq.logprobs.append(lp)
                delta = self._accept(seq, token, params, eos)
                stats.decode_tokens += 1
                if delta:
                    yield seq.index, delta

    def _admissible(self, waiting: list[Sequence]) -> bool:
        """The next waiting sequence fits: its blocks, and a slot of the recurrent-state pool."""
        slots = self.model.free_state_slots()
        return (bool(waiting) and self._budget(waiting[0]) <= self.model.kv_cache.allocator.free_blocks
                and (slots is None or slots > 0))

    def _retire(self, running: list[Sequence]):
        """The sequences still running; a finished one yields its held-back text and is released."""
        still = []
        for seq in running:
            if not seq.done:
                still.append(seq)
                continue
            tail = seq.text.finish() if seq.text is not None else ""
            if tail:
                yield seq.index, tail
            self.release(seq)
        return still

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
