"""Tokenizer: a ``tokenizers`` backend, the ids that end generation, and the chat template.

Built from an HF folder (tokenizer.json + tokenizer_config.json, optional chat_template.jinja)
or from GGUF metadata. Chat templates render with jinja2 the way transformers renders them
(sandboxed, trim_blocks/lstrip_blocks, ``raise_exception``, ``strftime_now``, ``tojson``).
"""

from __future__ import annotations

import json
import pathlib
import re
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from metrale_cli.checkpoint.json_file import read_json_object
from metrale_cli.config import token_id, token_ids
from metrale_cli.errors import MetraleError

# Special tokens that end an assistant turn in the chat formats metrale knows; any of them that
# the vocabulary holds stops generation, next to the config's eos ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                      "<|endoftext|>", "<|end_of_text|>", "</s>")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# The most characters, items or digits one *, % or ** of a chat template may make: "x" * 10**9
# would take the host's memory (3 ** 10**8 its time) before any error, so it is refused
# first, as the sandbox refuses a range() past MAX_RANGE items.
MAX_TEMPLATE_RESULT = 4 << 20


class StreamDecoder:
    """Turns token ids, one at a time, into printable text.

    ``push`` returns only new, complete text: a piece that ends in an incomplete UTF-8 sequence
    is held back until the following tokens complete it; ``flush`` returns whatever is left.
    """

    def __init__(self, tokenizer: "Tokenizer"):
        self._decode = tokenizer.decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window re-decoded each step
        self._read = 0    # ids before this were already returned

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        seen = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if text.endswith("\ufffd") or len(text) <= len(seen):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen):]

    def flush(self) -> str:
        seen = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(seen):]


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (assistant-mask markers): render the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_FORMAT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _repeat_size(left, right) -> int:
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
            return len(seq) * count
    return 0


def _format_size(fmt, args) -> int:
    """The padding ``fmt % args`` asks for: its fields' widths and precisions, a "*" one taken
    as the largest integer among ``args``."""
    if not isinstance(fmt, str):
        return 0
    star = max((v for v in (args if isinstance(args, tuple) else (args,)) if isinstance(v, int)), default=0)
    return sum(star if f == "*" else int(f) for m in _FORMAT_FIELD.finditer(fmt) for f in m.groups() if f)


def _power_digits(base, exponent) -> int:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        return abs(base).bit_length() * exponent * 3 // 10
    return 0


# operator -> (about) the characters, items or digits its result would have
_RESULT_SIZES = {"*": _repeat_size, "%": _format_size, "**": _power_digits}


class _ChatTemplateSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with every ``*``, ``%`` and ``**`` held to MAX_TEMPLATE_RESULT (an
    intercepted operator is not folded at compile time either)."""

    intercepted_binops = frozenset(_RESULT_SIZES)

    def call_binop(self, context, operator, left, right):
        size = _RESULT_SIZES[operator](left, right)
        if size > MAX_TEMPLATE_RESULT:
            raise OverflowError(f"the result of {operator} would hold {size} characters, items or digits; the "
                                f"sandbox allows {MAX_TEMPLATE_RESULT}")
        return super().call_binop(context, operator, left, right)


def compile_chat_template(source: str, origin: str = "the checkpoint") -> jinja2.Template:
    """A chat template compiled in transformers' jinja environment; ``origin``: where it came
    from (a file, a key), for the error line of a template that does not parse."""
    env = _ChatTemplateSandbox(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise MetraleError(f"the chat template from {origin} does not parse: {exc}",
                           "fix the template, or pass another with --chat-template FILE") from None


class Tokenizer:
    """Text <-> token ids for one model.

    ``bos_token_id``: prepended by ``encode(add_special_tokens=True)`` when the model wants it.
    ``eos_token_ids``: every id that ends generation (config eos ids + end-of-turn tokens).
    ``declared_ids``: the ids the checkpoint's files give, by file and key
    (``{"generation_config.json eos_token_id": [2]}``), for ``ModelConfig.check_token_ids``.
    """

    def __init__(self, backend: tokenizers.Tokenizer, bos_token_id: int | None,
                 eos_token_ids: list[int], chat_template: str | None,
                 special_tokens: dict[str, str] | None = None, template_origin: str = "the checkpoint",
                 declared_ids: dict[str, list[int]] | None = None):
        self.backend = backend
        self.declared_ids = dict(declared_ids or {})
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.chat_template, self.template_origin = chat_template, template_origin
        self.special_tokens = dict(special_tokens or {})
        self.template_kwargs: dict = {}  # more variables for the chat template (enable_thinking, ...)
        self._template = compile_chat_template(chat_template, template_origin) if chat_template else None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def set_chat_template(self, template: str, origin: str = "--chat-template") -> None:
        """Use ``template`` (Jinja, as HF's chat_template) in place of the checkpoint's."""
        self._template = compile_chat_template(template, origin)
        self.chat_template, self.template_origin = template, origin

    def set_chat_template_kwargs(self, kwargs: dict) -> None:
        """Render the chat template with these variables too (``{"enable_thinking": false}`` for
        Qwen3's), as transformers' apply_chat_template takes its extra keyword arguments."""
        reserved = sorted({"messages", "add_generation_prompt"} & set(kwargs))
        if reserved:
            raise MetraleError(f"--chat-template-kwargs may not set {', '.join(reserved)}: metrale sets them",
                               'e.g. --chat-template-kwargs \'{"enable_thinking": false}\'')
        self.template_kwargs = dict(kwargs)

    def unread_template_kwargs(self) -> list[str]:
        """The template_kwargs the chat template never reads (they change nothing)."""
        if self._template is None:
            return sorted(self.template_kwargs)
        read = jinja2.meta.find_undeclared_variables(self._template.environment.parse(self.chat_template))
        return sorted(set(self.template_kwargs) - read)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. A rendered chat template already holds its special tokens:
        encode it with ``add_special_tokens=False``."""
        _check_utf8(text)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...])."""
        if self._template is None:
            raise MetraleError("this model has no chat template",
                               "pass a raw prompt (no chat formatting) or use an instruct model")
        try:
            variables = {"tools": None, "documents": None, **self.special_tokens, **self.template_kwargs}
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except Exception as exc:  # 1/0, [1] + 3, strftime_now(5): whatever the template does wrong is its own fault
            raise MetraleError(f"the chat template failed: {type(exc).__name__}: {exc}",
                               f"fix the chat template ({self.template_origin}), or pass another with "
                               "--chat-template FILE") from None

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @classmethod
    def from_hf_folder(cls, path: pathlib.Path | str) -> "Tokenizer":
        """From tokenizer.json + tokenizer_config.json (+ chat_template.jinja, config eos ids)."""
        folder = pathlib.Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise MetraleError(f"{folder} has no tokenizer.json",
                               "metrale reads fast tokenizers only (tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception for any bad file
            raise MetraleError(f"{folder / 'tokenizer.json'} is not a tokenizer the tokenizers library reads: {e}",
                               "re-download the checkpoint's tokenizer.json") from None
        tok_config = read_json_object(folder / "tokenizer_config.json", optional=True)
        special = {k: _token_text(folder / "tokenizer_config.json", k, tok_config[k])
                   for k in SPECIAL_TOKEN_KEYS if tok_config.get(k)}
        config = read_json_object(folder / "config.json", optional=True)
        generation = read_json_object(folder / "generation_config.json", optional=True)
        given = {"config.json eos_token_id": config.get("eos_token_id"),
                 "generation_config.json eos_token_id": generation.get("eos_token_id")}
        declared = {where: token_ids(where, value) for where, value in given.items()}
        bos = token_id("config.json bos_token_id", config.get("bos_token_id"))
        declared["config.json bos_token_id"] = [] if bos is None else [bos]
        if bos is None and "bos_token" in special:
            bos = backend.token_to_id(special["bos_token"])
        eos_ids = [i for where in given for i in declared[where]]
        return cls._build(backend, bos, eos_ids, special, *_chat_template(folder, tok_config), declared)

    @classmethod
    def from_gguf(cls, meta: dict) -> "Tokenizer":
        """From GGUF metadata read as plain values (``gguf_io.metadata``: tokenizer.ggml.*)."""
        from metrale_cli.checkpoint.gguf_tokenizer import build_backend

        backend = build_backend(meta)
        tokens = meta["tokenizer.ggml.tokens"]
        ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
        special = {key: tokens[ids[name]] for key, name in
                   zip(SPECIAL_TOKEN_KEYS, ("bos", "eos", "unknown", "padding")) if ids[name] is not None}
        # ids past the token list were refused by build_backend; past the model's vocabulary, by
        # ModelConfig.check_token_ids, which names the key
        declared = {f"GGUF tokenizer.ggml.{k}_token_id": token_ids(f"GGUF tokenizer.ggml.{k}_token_id", ids[k])
                    for k in ("eos", "bos")}
        where = "GGUF tokenizer.chat_template"
        return cls._build(backend, ids["bos"], declared["GGUF tokenizer.ggml.eos_token_id"], special,
                          _template_text(where, meta.get("tokenizer.chat_template")), where, declared)

    @classmethod
    def _build(cls, backend, bos, eos_ids, special, chat_template, template_origin, declared) -> "Tokenizer":
        if "eos_token" in special and (eos := backend.token_to_id(special["eos_token"])) is not None:
            eos_ids = eos_ids + [eos]
        eos_ids += [i for t in END_OF_TURN_TOKENS if (i := backend.token_to_id(t)) is not None]
        return cls(backend, bos, eos_ids, chat_template, special, template_origin, declared)

    def save(self, folder: pathlib.Path) -> None:
        """Write tokenizer.json + tokenizer_config.json that ``from_hf_folder`` reads back."""
        self.backend.save(str(folder / "tokenizer.json"))
        config = {**self.special_tokens, "chat_template": self.chat_template}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def _check_utf8(text: str) -> None:
    """Every prompt meets here (argv, stdin, a chat turn, --system; through the template or raw).
    Bytes that are not UTF-8 arrive as lone surrogates (Python decodes argv and stdin with
    surrogateescape), which the tokenizers library refuses with a bare TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"the lone surrogate U+{code:04X}"
        where = f"after {text[max(0, exc.start - 20):exc.start]!r}" if exc.start else "at its start"
        raise MetraleError(f"the prompt is not valid UTF-8: {what} {where}",
                           "give the prompt as UTF-8 text (iconv -t UTF-8 converts it)") from None


def _token_text(path: pathlib.Path, key: str, value) -> str:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken object
    holding the text under "content"."""
    text = value.get("content") if isinstance(value, dict) else value
    if not isinstance(text, str):
        raise MetraleError(f"{path} {key} is {json.dumps(value)}: neither a token's text nor an object with "
                           'its text under "content"', f'e.g. "{key}": "<|im_end|>"; or re-download the checkpoint')
    return text


def _chat_template(folder: pathlib.Path, tok_config: dict) -> tuple[str | None, str]:
    """(the chat template, where it came from): chat_template.jinja wins over tokenizer_config's;
    a list of named templates -> "default"."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return _read_template(jinja), str(jinja)
    where = f"{folder / 'tokenizer_config.json'} chat_template"
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = _named_templates(where, template)
        template = named.get("default") or next(iter(named.values()), None)
    return _template_text(where, template), where


def _read_template(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MetraleError(f"{path} is not UTF-8 text ({exc})",
                           "save the template as UTF-8, or re-download the checkpoint") from None


def _named_templates(where: str, items: list) -> dict[str, str]:
    """tokenizer_config's list form, [{"name": ..., "template": ...}, ...] -> name -> template."""
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and isinstance(item.get("template"), str)):
            raise MetraleError(f'{where} item {i} is {json.dumps(item)[:80]}, not {{"name": ..., "template": "..."}}',
                               "re-download the checkpoint, or pass a template with --chat-template FILE")
    return {item.get("name"): item["template"] for item in items}


def _template_text(where: str, template) -> str | None:
    """The template as read from ``where``: Jinja text or nothing; jinja2 would fail on anything
    else only when compiling it, with no word of where it came from."""
    if template is not None and not isinstance(template, str):
        raise MetraleError(f"{where} is {json.dumps(template)[:80]}, not the template's text",
                           "re-download the checkpoint, or pass a template with --chat-template FILE")
    return template
