"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale_cli.errors import MetraleError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise MetraleError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise MetraleError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise MetraleError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise MetraleError(f"--top-k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (B, vocab) float32 -> (B,) int64 token ids."""
        p = self.params
        if p.greedy:
            return logits.argmax(dim=-1)
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative - sorted_logits.softmax(dim=-1) >= p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
