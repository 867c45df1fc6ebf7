"""A sequence being generated: its tokens, its block table and its streamed, stop-checked text."""

from __future__ import annotations

from dataclasses import dataclass, field


class StopText:
    """Streams decoded text, holding back what could still become a stop string."""

    def __init__(self, decoder, stop: tuple[str, ...]):
        self.decoder = decoder
        self.stop = tuple(stop)  # non-empty (SamplingParams refuses an empty one)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Feed one token; returns the text that is now safe to show."""
        self.text += self.decoder.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        self.text += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hold = 0
        for s in self.stop:
            at = self.text.find(s)
            if at >= 0:
                self.text, self.stopped, final = self.text[:at], True, True
        if not final and self.stop:
            hold = max(len(s) for s in self.stop) - 1
        end = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted : end], end
        return out


@dataclass
class Sequence:
    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: StopText | None = None
    states: list = field(default_factory=list)  # one per layer, from Layer.alloc_state
    logprobs: list[dict] = field(default_factory=list)  # per output token, with SamplingParams.logprobs

    @property
    def length(self) -> int:
        """Tokens in the sequence (prompt + generated)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
