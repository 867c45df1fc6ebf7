"""The chat command: a multi-turn session through the model's chat template, streamed.

On a terminal it reads a line per turn at a ``> `` prompt; with stdin not a terminal it takes
each non-empty line of stdin as one turn and never waits for a terminal. Lines starting with
``/`` are commands (:data:`COMMANDS`). Ctrl-C stops the answer being written (what was written
stays in the history) and the session goes on; Ctrl-D or ``/exit`` ends it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from metrale_cli.engine.llm import LLM, set_template
from metrale_cli.engine.runner import RunnerOptions, open_runner
from metrale_cli.engine.sampler import SamplingParams, with_model_defaults
from metrale_cli.engine.source import ModelSource
from metrale_cli.errors import MetraleError
from metrale_cli.output import Output

COMMANDS = {"/reset": "forget the conversation", "/system TEXT": "set the system message (the conversation "
            "starts over)", "/exit": "end the session (Ctrl-D too)", "/help": "this list"}
STOPPED = "stopped"  # the finish reason of an answer cut by Ctrl-C


@dataclass
class ChatSession:
    """A conversation: the system message and the turns so far, each answer streamed."""

    llm: LLM
    params: SamplingParams
    system: str | None = None
    history: list[dict] = field(default_factory=list)

    def messages(self, user: str) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history + [{"role": "user", "content": user}]

    def encode(self, user: str) -> list[int]:
        """The whole conversation and the new message through the chat template."""
        tokenizer = self.llm.tokenizer
        text = tokenizer.apply_chat_template(self.messages(user), add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def reset(self, system: str | None = None) -> None:
        self.history.clear()
        self.system = system if system is not None else self.system

    def answer(self, user: str, on_text: Callable[[str], None]) -> dict:
        """Stream the answer to ``user`` through ``on_text``; the turn goes into the history, an
        answer cut by Ctrl-C with what was written of it. -> the turn's record."""
        ids = self.encode(user)
        context = self.llm.runner.engine.max_seq_len
        if len(ids) >= context:
            raise MetraleError(f"the conversation with this message has {len(ids)} tokens; the context is "
                               f"{context} tokens (--max-seq-len)",
                               hint="/reset starts the conversation over; or raise --max-seq-len")
        run = self.llm.stream_ids(ids, self.params)
        pieces, seq = [], None
        try:
            while True:
                try:
                    delta = next(run)
                except StopIteration as done:
                    seq = done.value
                    break
                pieces.append(delta)
                on_text(delta)
        except KeyboardInterrupt:
            run.close()  # the engine gives the sequence's blocks back
        reply = "".join(pieces)
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        record = {"user": user, "text": reply, "prompt_tokens": len(ids)}
        if seq is None:
            return record | {"completion_tokens": None, "finish_reason": STOPPED}
        stats = self.llm.stats  # the first token comes from the prefill; a decode rate only where steps ran
        return record | {"completion_tokens": len(seq.output_ids), "finish_reason": seq.finish_reason,
                         "decode_tokens": stats.decode_tokens,
                         "decode_tokens_per_s": stats.decode_tps if stats.decode_tokens else None}


def _terminal_lines(out: Output) -> Iterable[str]:
    """Lines typed at a ``> `` prompt; Ctrl-C at the prompt says how to leave, Ctrl-D leaves."""
    while True:
        try:
            yield out.err.input("[bold]> [/bold]" if out.err.is_terminal else "> ")
        except KeyboardInterrupt:
            out.info("(/exit or Ctrl-D ends the session)")
        except EOFError:
            return


def run_chat(out: Output, model: str | None, opts: RunnerOptions, params: SamplingParams,
             system: str | None = None, lines: Iterable[str] | None = None, chat_template: str | None = None,
             explicit: frozenset[str] | None = None, template_kwargs: dict | None = None) -> int:
    """The session over ``lines`` (default: the terminal, else stdin's lines). -> the exit code:
    1 when a turn failed (a message past the context, an unknown command) with stdin not a
    terminal, so that scripts see it; 0 otherwise. ``chat_template``: Jinja text in place of the
    checkpoint's template, ``template_kwargs`` more variables for it; ``explicit``: the sampling fields the user set, the others taking the
    checkpoint's recommended values (None: ``params`` as given)."""
    interactive = lines is None and sys.stdin is not None and sys.stdin.isatty()
    if lines is None:
        lines = _terminal_lines(out) if interactive else (line.rstrip("\n") for line in sys.stdin)
    source = ModelSource.checkpoint(model)
    params, sampling = (params, None) if explicit is None else \
        with_model_defaults(params, explicit, source.sampling())
    with out.progress("loading weights") as progress:
        llm = LLM(open_runner(opts, source, progress))
    unread = set_template(llm.tokenizer, chat_template, template_kwargs)
    if not llm.tokenizer.has_chat_template:
        raise MetraleError(f"{llm.runner.source} has no chat template",
                           hint="use metrale generate --no-chat-template for raw text")
    out.info(f"chat with {llm.runner.source} · backend {llm.runner.backend} · kv {llm.runner.kv_dtype.value} · "
             f"context {llm.runner.engine.max_seq_len} tokens · /help for commands")
    for line in (sampling, unread):
        if line:
            out.info(line)
    session, failed = ChatSession(llm, params, system), False
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            name, _, rest = text.partition(" ")
            if name in ("/exit", "/quit"):
                break
            if name == "/reset":
                session.reset()
                out.info("the conversation starts over")
            elif name == "/system" and rest.strip():
                session.reset(rest.strip())
                out.info("system message set; the conversation starts over")
            elif name == "/system":
                out.error("/system needs the message's text", "e.g. /system Answer in one sentence.")
                failed = True
            elif name == "/help":
                for command, what in COMMANDS.items():
                    out.info(f"{command:14s} {what}")
            else:
                out.error(f"unknown command {text}", "commands: " + ", ".join(COMMANDS))
                failed = True
            continue
        try:
            record = session.answer(text, (lambda d: None) if out.json_mode else out.stream)
        except MetraleError as e:
            out.error(e.message, e.hint or "/reset starts the conversation over")
            failed = True
            continue
        if out.json_mode:
            out.json_line(record)
            continue
        out.stream("\n")
        if record["finish_reason"] == STOPPED:
            out.info("(stopped)")
        else:
            decoded = record["decode_tokens"]
            speed = f", {decoded} decoded at {record['decode_tokens_per_s']:.1f} tok/s" if decoded else ""
            out.info(f"{record['completion_tokens']} tokens{speed} · "
                     f"conversation {record['prompt_tokens'] + record['completion_tokens']} of "
                     f"{llm.runner.engine.max_seq_len} tokens")
    return 1 if failed and not interactive else 0
