"""Tokenizer from HF folders against transformers' AutoTokenizer; chat templates; streaming."""

from __future__ import annotations

import json

import pytest

from helpers_checkpoints import make_tokenizer
from metrale_cli.checkpoint.sampling_defaults import from_generation_config
from metrale_cli.errors import MetraleError
from metrale_cli.checkpoint.tokenizer import Tokenizer

TEXTS = ["Hello world!", "The quick brown fox.", "Café naïve déjà vu 日本語 🤖", "12345 + 2024 = ?",
         "  leading spaces\n\nand\ttabs", "<|im_start|>user\nhi<|im_end|>", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 🤖?"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    (path / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return path


@pytest.fixture(scope="module")
def pair(folder):
    from transformers import AutoTokenizer

    return Tokenizer.from_hf_folder(folder), AutoTokenizer.from_pretrained(str(folder))


def test_encode_decode_match_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    assert ours.decode(ours.encode(TEXTS[2])) == TEXTS[2]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt):
    ours, theirs = pair
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert text == theirs.apply_chat_template(MESSAGES, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n") is add_generation_prompt


THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {"enable_thinking": True}, {}])
def test_chat_template_kwargs_render_as_transformers_renders_them(folder, pair, kwargs):
    ours, theirs = Tokenizer.from_hf_folder(folder), pair[1]  # a tokenizer of its own: the pair's stays as read
    ours.set_chat_template(THINKING)
    ours.set_chat_template_kwargs(kwargs)
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                              chat_template=THINKING, **kwargs)
    assert text.endswith("</think>\n\n") is (kwargs == {"enable_thinking": False})
    ours.set_chat_template_kwargs(kwargs | {"reasoning_effort": "low"})
    assert ours.unread_template_kwargs() == ["reasoning_effort"]  # the template never reads it
    with pytest.raises(MetraleError, match="may not set add_generation_prompt, messages"):
        ours.set_chat_template_kwargs({"messages": [], "add_generation_prompt": False})


def test_special_ids(pair):
    ours, theirs = pair
    assert [theirs.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert ours.bos_token_id == 1 and ours.has_chat_template
    # config eos (2 = <|im_end|>, also the tokenizer's eos_token), then <|endoftext|>, no repeats
    assert ours.eos_token_ids == [2, 0]
    assert ours.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                   "pad_token": "<|endoftext|>"}


def test_stream_decoder_holds_back_partial_characters(pair):
    ours, _ = pair
    text = "Café 日本語 🤖 done"
    ids = ours.encode(text)
    stream = ours.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") > 0  # multi-byte characters span several byte-level tokens


def test_stream_decoder_flush_returns_the_incomplete_tail(pair):
    ours, _ = pair
    robot = ours.encode("🤖")
    assert len(robot) > 1
    stream = ours.stream_decoder()
    assert stream.push(ours.encode("ok")[0]) == "o"
    assert [stream.push(i) for i in robot[:-1]] == [""] * (len(robot) - 1)
    assert stream.flush() == ours.decode(ours.encode("o") + robot[:-1])[1:]
    assert stream.flush() == ""


def _folder_with(tmp_path, template_config=None, jinja=None):
    make_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config.pop("chat_template", None)
    if template_config is not None:
        config["chat_template"] = template_config
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return Tokenizer.from_hf_folder(tmp_path)


def test_template_sources_and_helpers(tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    assert _folder_with(tmp_path / "a", named).apply_chat_template([]) == "DEFAULT"
    assert _folder_with(tmp_path / "b", "FROM CONFIG", jinja="FROM FILE").apply_chat_template([]) == "FROM FILE"
    helpers = ("{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}|"
               "{% for m in messages %}{% generation %}{{ m.role }}{% endgeneration %}{% break %}{% endfor %}"
               "|{{ bos_token }}")
    tok = _folder_with(tmp_path / "c", helpers)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}, {"role": "x", "content": ""}]) == \
        '{"role": "user", "content": "é"}|4|user|<|im_start|>'


def test_template_errors_are_metrale_errors(tmp_path):
    tok = _folder_with(tmp_path / "a", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(MetraleError) as info:
        tok.apply_chat_template(MESSAGES)
    assert info.value.message == "the chat template failed: TemplateError: roles must alternate"
    assert info.value.hint.startswith(f"fix the chat template ({tmp_path / 'a' / 'tokenizer_config.json'} "
                                      "chat_template)")
    with pytest.raises(MetraleError, match="does not parse"):
        _folder_with(tmp_path / "b", "{% for %}")
    bare = _folder_with(tmp_path / "c")
    assert not bare.has_chat_template
    with pytest.raises(MetraleError, match="no chat template"):
        bare.apply_chat_template(MESSAGES)


@pytest.mark.parametrize("template, fault", [
    (5, "chat_template is 5, not the template's text"),
    ({"a": 1}, """chat_template is {"a": 1}, not the template's text"""),
    ([{"name": "x", "template": 5}], 'chat_template item 0 is {"name": "x", "template": 5}, not {"name": ..., '
                                     '"template": "..."}'),
    (["a", "b"], 'chat_template item 0 is "a", not {"name": ..., "template": "..."}'),
])
def test_a_chat_template_that_is_not_text_is_one_error_naming_its_key(tmp_path, template, fault):
    """Not jinja2's "Can't compile non template nodes" (nor an AttributeError from a list of
    strings): the line says which file and key hold what."""
    with pytest.raises(MetraleError) as info:
        _folder_with(tmp_path, template)
    assert info.value.message == f"{tmp_path / 'tokenizer_config.json'} {fault}"


def test_a_chat_template_file_that_is_not_utf8_is_one_error(tmp_path):
    make_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{x}}")
    with pytest.raises(MetraleError) as info:
        Tokenizer.from_hf_folder(tmp_path)
    assert info.value.message.startswith(f"{tmp_path / 'chat_template.jinja'} is not UTF-8 text ('utf-8' codec "
                                         "can't decode byte 0xff in position 0")


@pytest.mark.parametrize("template, failure", [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ("{{ [1,2] + 3 }}", 'TypeError: can only concatenate list (not "int") to list'),
    ('{{ "%d" % "a" }}', "TypeError: %d format: a real number is required, not str"),
    ("{{ strftime_now(5) }}", "TypeError: strftime() argument 1 must be str, not int"),
    ("{{ range(10**9)|list }}", "OverflowError: Range too big. The sandbox blocks ranges larger than MAX_RANGE "
                                "(100000)."),
    ("{{ messages.nope.deeper }}", "UndefinedError: 'list object' has no attribute 'nope'"),
    # results past MAX_TEMPLATE_RESULT (4194304) are refused before they are made
    ('{{ "x" * 5000000 }}', "OverflowError: the result of * would hold 5000000 characters, items or digits; "
                            "the sandbox allows 4194304"),
    ("{{ 5000000 * [0] }}", "OverflowError: the result of * would hold 5000000 characters, items or digits; "
                            "the sandbox allows 4194304"),
    ('{{ "%5000000d" % 1 }}', "OverflowError: the result of % would hold 5000000 characters, items or digits; "
                              "the sandbox allows 4194304"),
    ('{{ "%-*s|" % (5000000, "a") }}', "OverflowError: the result of % would hold 5000000 characters, items or "
                                       "digits; the sandbox allows 4194304"),
    ("{{ 3 ** 10000000 }}", "OverflowError: the result of ** would hold 6000000 characters, items or digits; "
                            "the sandbox allows 4194304"),
])
def test_a_chat_template_that_fails_while_rendering_is_one_error(folder, template, failure):
    """Whatever goes wrong inside the template is its fault, named by its exception; "x" * 10**9
    would take the host's memory before failing, so results that large are refused first."""
    tok = Tokenizer.from_hf_folder(folder)
    tok.set_chat_template(template)
    with pytest.raises(MetraleError) as info:
        tok.apply_chat_template(MESSAGES)
    assert info.value.message == f"the chat template failed: {failure}"
    assert info.value.hint == "fix the chat template (--chat-template), or pass another with --chat-template FILE"


@pytest.mark.parametrize("text, fault", [
    ("caf\udce9 ok", "byte 0xe9 after 'caf'"),  # b"caf\xe9" as Python decodes argv and stdin
    ("\udcff", "byte 0xff at its start"),
    ("a\ud800", "the lone surrogate U+D800 after 'a'"),
])
def test_text_that_is_not_utf8_is_one_error(pair, text, fault):
    with pytest.raises(MetraleError) as info:
        pair[0].encode(text)
    assert info.value.message == f"the prompt is not valid UTF-8: {fault}"


@pytest.mark.parametrize("name", ["tokenizer_config.json", "config.json", "generation_config.json"])
@pytest.mark.parametrize("text, message", [("[1]", "is not a JSON object"), ("{", "is not valid JSON")])
def test_a_broken_json_file_beside_the_tokenizer_is_one_error(tmp_path, name, text, message):
    """Each JSON file the tokenizer reads, valid JSON but not an object (a list here) included:
    one error naming the file, not an AttributeError from a list's missing .get."""
    make_tokenizer(tmp_path)
    (tmp_path / name).write_text(text)
    with pytest.raises(MetraleError, match=f"{name} {message}"):
        Tokenizer.from_hf_folder(tmp_path)


def _with_config(folder, **changes):
    """The tiny tokenizer in ``folder`` with these tokenizer_config.json keys changed."""
    make_tokenizer(folder)
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return path


def test_a_special_token_as_an_added_token_object_reads_its_content(tmp_path):
    _with_config(tmp_path, bos_token={"content": "<|im_start|>", "special": True})
    assert Tokenizer.from_hf_folder(tmp_path).special_tokens["bos_token"] == "<|im_start|>"


@pytest.mark.parametrize("value", [{"foo": 1}, {"content": 5}, 5, ["<|im_start|>"]])
def test_a_special_token_that_is_not_text_is_one_error(tmp_path, value):
    """Not a KeyError for an object without "content", nor the str() of a number or list taken
    as the token's text."""
    path = _with_config(tmp_path, bos_token=value)
    with pytest.raises(MetraleError) as info:
        Tokenizer.from_hf_folder(tmp_path)
    assert info.value.message == (f"{path} bos_token is {json.dumps(value)}: neither a token's text nor an "
                                  'object with its text under "content"')


@pytest.mark.parametrize("name", ["tokenizer_config.json", "config.json", "generation_config.json"])
def test_a_json_file_that_is_a_directory_is_one_error_not_an_absent_file(tmp_path, name):
    """An optional file is optional when nothing is there: a directory in its place is named."""
    make_tokenizer(tmp_path)
    (tmp_path / name).unlink(missing_ok=True)
    (tmp_path / name).mkdir()
    with pytest.raises(MetraleError, match=f"{name} is not a readable file"):
        Tokenizer.from_hf_folder(tmp_path)
    if name == "generation_config.json":
        with pytest.raises(MetraleError, match=f"{name} is not a readable file"):
            from_generation_config(tmp_path)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(MetraleError, match="has no tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_gguf_metadata_errors():
    with pytest.raises(MetraleError, match="has no tokenizer"):
        Tokenizer.from_gguf({"general.architecture": "llama"})
    with pytest.raises(MetraleError, match="tokenizer model 'bert' is not supported"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(MetraleError, match="pre-tokenizer 'deepseek-llm' is not supported"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
                             "tokenizer.ggml.pre": "deepseek-llm"})


def test_gguf_add_bos_token_prepends_bos(folder):
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"] | {a["content"]: a["id"] for a in spec["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]],
            "tokenizer.ggml.token_type": [3 if t.startswith("<|") else 1 for t in tokens],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.add_bos_token": True}
    tok = Tokenizer.from_gguf(meta)
    plain = Tokenizer.from_hf_folder(folder)
    assert tok.encode("Hello world!") == [1] + plain.encode("Hello world!")
    assert tok.encode("Hello world!", add_special_tokens=False) == plain.encode("Hello world!")
    assert tok.decode(tok.encode("Hello <|im_end|>")) == "Hello "
