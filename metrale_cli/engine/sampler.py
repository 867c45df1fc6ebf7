"""Next-token choice: greedy, or temperature / top-k / top-p / min-p sampling, after the
repetition, presence and frequency penalties. With a seed each sequence draws from a stream of its
own, keyed by the seed, its prompt and which copy of that prompt it is: its tokens do not depend on
the other sequences of the run, their order or the batches they decode in."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from metrale_cli.errors import MetraleError


MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs


# The knobs a user or a checkpoint sets: field -> (type, the values it takes, those in words, hint).
# A temperature of nan would reach the sampler, and inf flattens it to noise.
KNOBS = {"temperature": (float, lambda v: 0 <= v < math.inf, "a finite number >= 0", "0 is greedy"),
         "top_k": (int, lambda v: v >= 0, ">= 0", "0 is off"),
         "top_p": (float, lambda v: 0 < v <= 1, "in (0, 1]", "1 is off"),
         "min_p": (float, lambda v: 0 <= v <= 1, "in [0, 1]", "0 is off"),
         "repetition_penalty": (float, lambda v: 0 < v < math.inf, "a finite number > 0", "1 is off")}


def flag(name: str) -> str:
    """A SamplingParams field's command-line option."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # HF's: a seen token's logit / p (if > 0) or * p; 1 = off
    presence_penalty: float = 0.0  # OpenAI's: - p for a token the output has; 0 = off
    frequency_penalty: float = 0.0  # OpenAI's: - p times the output's count of the token; 0 = off
    min_p: float = 0.0  # keep tokens with probability >= min_p times the top one's; 0 = off
    logprobs: int = 0  # per generated token: its log-probability and the N likeliest tokens'; 0 = off

    def __post_init__(self):
        for name, (_, ok, what, hint) in KNOBS.items():
            if not ok(getattr(self, name)):
                raise MetraleError(f"{flag(name)} must be {what}, got {getattr(self, name)}", hint=hint)
        for option, value in (("--presence-penalty", self.presence_penalty),
                              ("--frequency-penalty", self.frequency_penalty)):
            if not -2 <= value <= 2:
                raise MetraleError(f"{option} must be in [-2, 2], got {value}", hint="0 is off")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise MetraleError(f"--logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", hint="0 is off")
        if self.max_new_tokens < 1:
            raise MetraleError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}", hint="e.g. -n 256")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:  # what torch.Generator takes
            raise MetraleError(f"--seed must be in [-2**63, 2**64), got {self.seed}", hint="e.g. --seed 1")
        if any(not s for s in self.stop):  # an empty string would stop nowhere, or everywhere
            raise MetraleError("--stop takes a non-empty string", hint="e.g. --stop '###'; leave it out for none")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a choice depends on the tokens so far (repetition, presence, frequency)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def with_model_defaults(params: SamplingParams, explicit: frozenset[str], defaults) -> tuple[SamplingParams, str | None]:
    """``params`` with the checkpoint's recommended values (``defaults``: a SamplingDefaults) for
    the fields the user left unset (``explicit`` names those they set), as transformers' generate
    applies a generation_config.json (vLLM too, less the defaults transformers fills in for keys
    the file leaves out); and the line that says which it took, or None."""
    taken = {name: _model_value(defaults, name) for name in defaults.values if name not in explicit}
    if dataclasses.replace(params, **taken).greedy:  # a greedy run reads no sampling value, only the penalty
        taken = {name: v for name, v in taken.items() if name == "repetition_penalty"}
    if not taken:
        return params, None
    merged = dataclasses.replace(params, **taken)
    own = ", ".join(f"{name} {v:g}" for name, v in taken.items() if name not in defaults.implied)
    filled = ", ".join(f"{name} {v:g}" for name, v in taken.items() if name in defaults.implied)
    line = (f"sampling: {own or 'do_sample'} from the model's {defaults.source}"
            + (f" ({filled} by transformers' defaults)" if filled else "")
            + ("; -t 0 decodes greedily" if not merged.greedy else "") + "; an option you set overrides its value")
    return merged, line


def _model_value(defaults, name: str):
    """The checkpoint's value of a knob, held to KNOBS as the option is (only applied values are)."""
    value = defaults.values[name]
    kind, ok, what, _ = KNOBS[name]
    number = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (kind is int and value != int(value)) or not ok(value):
        raise MetraleError(f"{defaults.source} {name} must be {'an integer ' if kind is int else ''}{what}, "
                           f"got {value!r}", f"fix the file, or set {flag(name)} on the command line")
    return kind(value)


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor,
                    params: SamplingParams) -> torch.Tensor:
    """vLLM's order: the repetition penalty over the prompt's and the output's tokens (``seen``,
    (B, V) bool), then the frequency and presence penalties over the output's counts ((B, V))."""
    p = params
    if p.repetition_penalty != 1:
        penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if p.frequency_penalty:
        logits = logits - p.frequency_penalty * counts
    if p.presence_penalty:
        logits = logits - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def warped_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(B, V) logits -> the distribution a sampled token is drawn from: temperature, top-k, top-p
    and min-p as HF's warpers apply them, in their order (the tokens they drop at probability 0)."""
    # the top logit shifted to 0 first: a tiny temperature then sends the others to -inf, where
    # dividing as they are overflows to inf and the softmax to nan (the same distribution else)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1:
        # HF's form: the tail's mass summed from its least likely token, where fp32 keeps it exact
        # (the likeliest first, the sum near 1 drifts by ~1e-5 over a 150k vocab: a top_p of 0.999
        # then kept hundreds of tokens more or less than it should)
        ascending, order = logits.sort(dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - p.top_p
        drop[..., -1] = False  # the likeliest token stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    if p.min_p:
        probs = probs.masked_fill(probs < p.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


class Sampler:
    """Picks each row's next token. With penalties it keeps, on the device, which tokens each
    sequence has seen (prompt and output) and how often its output has each: :meth:`start` at a
    sequence's prefill, then every call names its rows' sequences and counts what it picked, so
    the pipelined decode never waits for the host."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.device = device
        self._seen: torch.Tensor | None = None  # (sequences, V) bool
        self._counts: torch.Tensor | None = None  # (sequences, V) float32: the output's tokens
        self._slot: dict[int, int] = {}  # sequence index -> row of those buffers
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}  # a batch's rows, on the device
        self.generator = None  # unseeded: one stream for every row
        self._streams: dict[int, torch.Generator] = {}  # seeded: sequence index -> its own stream
        self._copies: dict[bytes, int] = {}  # seeded: a prompt's digest -> the sequences started with it
        if not params.greedy and params.seed is None:
            self.generator = torch.Generator(device=device)
            self.generator.seed()

    def start(self, index: int, prompt_ids: list[int], vocab: int) -> None:
        """Sequence ``index`` begins: nothing of its output yet, its prompt's tokens seen; with a
        seed, its stream is keyed (seed, prompt, how many sequences began with that prompt before)."""
        if self.params.seed is not None and not self.params.greedy:
            self._streams[index] = self._stream(prompt_ids)
        if not self.params.penalized:
            return
        row = self._row(index, vocab)
        self._seen[row] = False
        self._counts[row] = 0
        if prompt_ids:
            self._seen[row, torch.tensor(prompt_ids, device=self.device)] = True

    def _stream(self, prompt_ids: list[int]) -> torch.Generator:
        prompt = hashlib.blake2b(np.asarray(prompt_ids, dtype="<i8").tobytes()).digest()
        copy = self._copies.get(prompt, 0)
        self._copies[prompt] = copy + 1
        return self._keyed(b"prompt" + prompt + copy.to_bytes(8, "little"))

    def _keyed(self, what: bytes) -> torch.Generator:
        """A generator seeded from (the run's seed, what): 63 bits of their digest."""
        key = hashlib.blake2b(self.params.seed.to_bytes(16, "little", signed=True) + what, digest_size=8).digest()
        return torch.Generator(device=self.device).manual_seed(int.from_bytes(key, "little") >> 1)

    def _row(self, index: int, vocab: int) -> int:
        if index not in self._slot:
            self._slot[index] = len(self._slot)
        rows = len(self._slot)
        if self._seen is None or self._seen.shape[0] < rows:
            grow = max(rows, 2 * (0 if self._seen is None else self._seen.shape[0]))
            seen = torch.zeros(grow, vocab, dtype=torch.bool, device=self.device)
            counts = torch.zeros(grow, vocab, dtype=torch.float32, device=self.device)
            if self._seen is not None:
                seen[: self._seen.shape[0]], counts[: self._counts.shape[0]] = self._seen, self._counts
            self._seen, self._counts = seen, counts
        return self._slot[index]

    def _batch_rows(self, indices: list[int], vocab: int) -> torch.Tensor:
        key = tuple(indices)
        if key not in self._rows:  # one host-to-device copy per batch composition, not per step
            self._rows[key] = torch.tensor([self._row(i, vocab) for i in indices], device=self.device)
        return self._rows[key]

    def __call__(self, logits: torch.Tensor, indices: list[int] | None = None) -> torch.Tensor:
        """logits: (B, vocab) float32 -> (B,) int64 token ids. ``indices``: the sequence of each
        row (needed with penalties: row i is sequence i without them)."""
        p = self.params
        rows = None
        indices = list(range(logits.shape[0])) if indices is None else indices
        if p.penalized:
            rows = self._batch_rows(indices, logits.shape[-1])
            logits = apply_penalties(logits, self._seen[rows], self._counts[rows], p)
        tokens = self._pick(logits, indices)
        if rows is not None:
            self._counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
            self._seen[rows, tokens] = True
        return tokens

    def logprobs_of(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
        """With ``logprobs`` N: (B, 1 + 2N) float32 on the device, each row the picked token's
        log-probability, then the N likeliest tokens' log-probabilities and their ids. Of the
        model's own distribution (log-softmax of the logits, before penalties and temperature)."""
        n = self.params.logprobs
        if not n:
            return None
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = lp.topk(min(n, lp.shape[-1]), dim=-1)
        return torch.cat([lp.gather(1, tokens[:, None]), top.values, top.indices.float()], dim=1)

    def _pick(self, logits: torch.Tensor, indices: list[int]) -> torch.Tensor:
        p = self.params
        if p.greedy:
            return logits.argmax(dim=-1)
        probs = warped_probs(logits, p)
        # a draw from probs as an exponential race: the token of the largest p / E, E ~ Exp(1)
        # independent per token (a token's chance to win is its p over the row's sum)
        race = torch.empty_like(probs)
        if self.generator is not None:
            race.exponential_(generator=self.generator)
        else:  # a stream a sequence: a row's draws are its own, whatever the batch
            for row, index in enumerate(indices):
                race[row].exponential_(generator=self._seeded(index))
        return torch.where(probs > 0, probs / race, -1.0).argmax(dim=-1)

    def _seeded(self, index: int) -> torch.Generator:
        if index not in self._streams:  # a row not begun by start (logits sampled directly): keyed by its index
            self._streams[index] = self._keyed(b"row" + index.to_bytes(8, "little", signed=True))
        return self._streams[index]
