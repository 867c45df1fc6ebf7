"""A ``tokenizers`` backend from GGUF tokenizer metadata (``tokenizer.ggml.*``).

``tokenizer.ggml.model`` picks the model: "gpt2" = byte-level BPE, whose ``tokenizer.ggml.pre``
picks the pre-tokenizer llama.cpp would use (the table below); "llama" = SentencePiece BPE
(Llama 2, Mistral, ...): pieces with scores, "▁" for spaces, byte fallback to ``<0xXX>``.
"""

from __future__ import annotations

from typing import Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from metrale_cli.config import token_id
from metrale_cli.errors import MetraleError

TOKEN_TYPE_CONTROL = 3       # llama.cpp token types: 3 = control (special), 4 = user-defined
TOKEN_TYPE_USER_DEFINED = 4
BROKEN = "the file's tokenizer metadata is broken: re-download it, or load the model's HF folder instead"
# tokenizer.ggml.* lists -> (the type of every item, its name): anything else is refused by the
# key's name before the tokenizers library meets it (it raises TypeError or a bare Exception)
LIST_ITEMS = {"tokenizer.ggml.tokens": (str, "a string"), "tokenizer.ggml.merges": (str, "a string"),
              "tokenizer.ggml.token_type": (int, "an integer"), "tokenizer.ggml.scores": ((int, float), "a number")}
# the keys that give a token by its index in tokenizer.ggml.tokens
ID_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "unknown", "padding"))

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _gpt2_bytes() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre -> (normalizer or None, pre-tokenizer). A file without the key gets
# "default", GPT-2's byte-level split (llama.cpp's default too); an unlisted name is refused:
# another model's split would tokenize some text differently, which is wrong output.
PRE_TOKENIZERS: dict[str, Callable[[], tuple]] = {
    "default": lambda: (None, _gpt2_bytes()),
    "gpt2": lambda: (None, _gpt2_bytes()),
    "smollm": lambda: (None, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), _gpt2_bytes()])),
    "qwen2": lambda: (normalizers.NFC(), _split_then_bytes(_QWEN2_SPLIT)),
    "llama-bpe": lambda: (None, _split_then_bytes(_LLAMA3_SPLIT)),
}


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bad = next((i for i, pair in enumerate(pairs) if len(pair) != 2 or not all(pair)), None)
    if bad is not None:
        raise MetraleError(f"GGUF tokenizer.ggml.merges[{bad}] is {merges[bad]!r}, not two tokens joined by a space",
                           BROKEN)
    return pairs


def _bpe_backend(meta: dict) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = _merge_pairs(meta.get("tokenizer.ggml.merges", []))
    try:
        model = BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                    continuing_subword_prefix="", end_of_word_suffix="")
    except Exception as exc:  # the tokenizers library raises a bare Exception for a merge of unknown tokens
        raise MetraleError(f"GGUF tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {exc}", BROKEN) from None
    backend = Tokenizer(model)
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre_name, str) or pre_name not in PRE_TOKENIZERS:
        raise MetraleError(f"GGUF pre-tokenizer {pre_name!r} is not supported",
                           f"supported: {', '.join(PRE_TOKENIZERS)}; or load the model's HF folder instead")
    normalizer, pre = PRE_TOKENIZERS[pre_name]()
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    _add_typed_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type", []))
    backend.post_processor = _post_processor(meta, tokens)
    return backend


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a piece into two pieces of the vocabulary,
    the best-scored result first (as transformers' GGUF converter orders them, so both
    tokenize alike); for one piece, the split whose parts score best first."""
    score = dict(zip(tokens, scores))
    merges = []
    for piece, piece_score in score.items():
        local = [(piece[:i], piece[i:], piece_score) for i in range(1, len(piece))
                 if piece[:i] in score and piece[i:] in score]
        merges += sorted(local, key=lambda m: (score[m[0]], score[m[1]]), reverse=True)
    merges.sort(key=lambda m: m[2], reverse=True)  # stable: ties keep the order above
    return [(left, right) for left, right, _ in merges]


def _spm_backend(meta: dict) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.scores" not in meta:
        raise MetraleError("the GGUF SentencePiece tokenizer has no scores (tokenizer.ggml.scores)")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, _spm_merges(tokens, meta["tokenizer.ggml.scores"]),
                            unk_token=None if unk is None else tokens[unk], fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    _add_typed_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type", []))
    bos = _bos_processor(meta, tokens, default=True)  # llama.cpp adds BOS to SentencePiece vocabularies
    if bos is not None:
        backend.post_processor = bos
    return backend


def _add_typed_tokens(backend: Tokenizer, tokens: list[str], types: list[int]) -> None:
    special = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _post_processor(meta: dict, tokens: list[str]):
    return _bos_processor(meta, tokens) or processors.ByteLevel(trim_offsets=False)


def _bos_processor(meta: dict, tokens: list[str], default: bool = False):
    """BOS before the text when the file says so (``add_bos_token``), else None."""
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", default) and bos is not None:
        return processors.TemplateProcessing(single=f"{tokens[bos]}:0 $A:0",
                                             pair=f"{tokens[bos]}:0 $A:0 $B:1",
                                             special_tokens=[(tokens[bos], bos)])
    return None


# tokenizer.ggml.model -> backend builder.
TOKENIZER_MODELS: dict[str, Callable[[dict], Tokenizer]] = {
    "gpt2": _bpe_backend,
    "llama": _spm_backend,
}


def _check_lists(meta: dict) -> None:
    for key, (kind, name) in LIST_ITEMS.items():
        items = meta.get(key, [])
        if not isinstance(items, list):
            raise MetraleError(f"GGUF {key} is {items!r:.60}, not a list", BROKEN)
        bad = next((i for i, item in enumerate(items) if not isinstance(item, kind)), None)
        if bad is not None:
            raise MetraleError(f"GGUF {key}[{bad}] is {items[bad]!r:.60}, not {name}", BROKEN)


def _check_ids(meta: dict) -> None:
    count = len(meta["tokenizer.ggml.tokens"])
    for key in ID_KEYS:
        index = token_id(f"GGUF {key}", meta.get(key))
        if index is not None and not 0 <= index < count:
            raise MetraleError(f"GGUF {key} {index} is past the token list (tokenizer.ggml.tokens holds {count})",
                               BROKEN)


def build_backend(meta: dict) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` described by GGUF metadata; MetraleError when unsupported
    or broken (a list of the wrong items, a token id past the list), naming the key."""
    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in meta:
        raise MetraleError("the GGUF file has no tokenizer (tokenizer.ggml.* metadata)")
    if not isinstance(model, str) or model not in TOKENIZER_MODELS:
        raise MetraleError(f"GGUF tokenizer model {model!r} is not supported",
                           f"supported: {', '.join(TOKENIZER_MODELS)}")
    _check_lists(meta)
    _check_ids(meta)
    return TOKENIZER_MODELS[model](meta)
