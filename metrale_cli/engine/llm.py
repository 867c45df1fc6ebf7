"""LLM: a built runner with its tokenizer, as the Python API and ``metrale generate`` use it:
prompts through the chat template, batched or streamed generation, completions."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass

from metrale_cli.engine.generate import GenerationStats
from metrale_cli.engine.runner import Runner
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.engine.sequence import Sequence


@dataclass(frozen=True)
class Completion:
    """One prompt's result: the generated text and token ids, and why it stopped (``eos``,
    ``stop``, ``length`` or ``context``)."""

    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[dict] | None = None  # with SamplingParams.logprobs: per token (engine.generate.logprob_record)


def render_prompt(tokenizer, prompt: str, chat: bool = True, system: str | None = None) -> list[int]:
    """A prompt's token ids: through the model's chat template (with an optional system message)
    when ``chat`` and the model has one, else the raw text."""
    if chat and tokenizer.has_chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                add_special_tokens=False)
    return tokenizer.encode(prompt, add_special_tokens=True)


def set_template(tokenizer, template: str | None, kwargs: dict | None) -> str | None:
    """The user's chat template (Jinja text in place of the checkpoint's) and its extra variables;
    -> the line that names the variables the template never reads, or None."""
    if template is not None:
        tokenizer.set_chat_template(template)
    if not kwargs:
        return None
    tokenizer.set_chat_template_kwargs(kwargs)
    unread = tokenizer.unread_template_kwargs()
    return f"the chat template reads no {', '.join(unread)}: --chat-template-kwargs changes nothing there" \
        if unread else None


class LLM:
    """A loaded model with its tokenizer and KV cache, ready to generate (:func:`load`)."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self.stats: GenerationStats | None = None  # the last generate / stream call's speed

    @property
    def messages(self) -> list[str]:
        """What the run says once: model, KV cache layout and capacity, calibration, decode mode."""
        return list(self.runner.messages)

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    def encode(self, prompt: str, chat: bool = True, system: str | None = None) -> list[int]:
        """The prompt's token ids (:func:`render_prompt`)."""
        return render_prompt(self.runner.tokenizer, prompt, chat, system)

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None, *, chat: bool = True,
                 system: str | None = None, on_text=None, **sampling) -> Completion | list[Completion]:
        """Generate for one prompt (-> a :class:`Completion`) or several, decoded together as one
        batch (-> a list). ``sampling``: :class:`SamplingParams` fields (``max_new_tokens``,
        ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``ignore_eos``); greedy by default.
        ``on_text(prompt index, text)`` receives the text as it is decoded."""
        many = not isinstance(prompts, str)
        texts = list(prompts) if many else [prompts]
        done = self.complete(texts, [self.encode(p, chat, system) for p in texts], params or SamplingParams(**sampling),
                             on_text)
        return done if many else done[0]

    def complete(self, texts: list[str], ids: list[list[int]], params: SamplingParams, on_text=None) -> list[Completion]:
        """:meth:`generate` for prompts already encoded (``ids``; ``texts`` label the results)."""
        seqs, self.stats = self.runner.engine.generate(ids, params, self._eos(), self.runner.tokenizer, on_text)
        return [self._completion(p, s) for p, s in zip(texts, seqs)]

    def stream(self, prompt: str, params: SamplingParams | None = None, *, chat: bool = True,
               system: str | None = None, **sampling) -> Iterator[str]:
        """The generated text of one prompt, piece by piece as it is decoded (text that could still
        become a stop string is held back until it cannot)."""
        yield from self.stream_ids(self.encode(prompt, chat, system), params or SamplingParams(**sampling))

    def stream_ids(self, ids: list[int], params: SamplingParams) -> Generator[str, None, Sequence]:
        """:meth:`stream` for a prompt already encoded; returns the finished sequence. Closing it
        early gives the sequence's blocks back."""
        run = self.runner.engine.stream([ids], params, self._eos(), self.runner.tokenizer)
        while True:
            try:
                _, delta = next(run)
            except StopIteration as done:
                seqs, self.stats = done.value
                return seqs[0]
            yield delta

    def _eos(self) -> set[int]:
        return set(self.runner.tokenizer.eos_token_ids) | set(self.runner.config.eos_token_ids)

    @staticmethod
    def _completion(prompt: str, seq: Sequence) -> Completion:
        return Completion(prompt, seq.text.text, list(seq.output_ids), seq.finish_reason, len(seq.prompt_ids),
                          list(seq.logprobs) or None)
