"""A checkpoint's recommended sampling (generation_config.json, GGUF general.sampling.*) applied
where the user set no value, as transformers' generate and vLLM apply it, and said in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers_checkpoints import make_hf_checkpoint, write_gguf
from metrale_cli.checkpoint.sampling_defaults import NONE, from_generation_config, from_gguf_metadata
from metrale_cli.engine.sampler import SamplingParams, with_model_defaults
from metrale_cli.errors import MetraleError
from test_cli import metrale


def _folder(tmp_path, config) -> object:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_do_sample_config_is_read_as_transformers_generate_reads_it(tmp_path):
    llama = from_generation_config(_folder(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                                                      "bos_token_id": 1}))
    assert llama.values == {"temperature": 0.6, "top_k": 50, "top_p": 0.9} and llama.implied == {"top_k"}
    qwen = from_generation_config(_folder(tmp_path, {"do_sample": True, "temperature": 0.7, "top_k": 20,
                                                     "top_p": 0.8, "repetition_penalty": 1.05}))
    assert qwen.values == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}
    greedy = from_generation_config(_folder(tmp_path, {"temperature": 0.6, "repetition_penalty": 1.2}))
    assert greedy.values == {"repetition_penalty": 1.2}  # no do_sample: transformers decodes greedily
    assert from_generation_config(_folder(tmp_path, {"do_sample": False, "top_p": 0.9})) is NONE
    assert from_generation_config(tmp_path / "nowhere") is NONE


@pytest.mark.parametrize("text, match", [("{", "not valid JSON"), ("[1]", "not a JSON object"),
                                         ('{"do_sample": "yes"}', "do_sample must be true or false")])
def test_a_broken_generation_config_is_one_error(tmp_path, text, match):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(MetraleError, match=match):
        from_generation_config(tmp_path)


def test_the_models_values_fill_what_the_user_left_unset(tmp_path):
    qwen = from_generation_config(_folder(tmp_path, {"do_sample": True, "temperature": 0.7, "top_k": 20,
                                                     "top_p": 0.8}))
    params, line = with_model_defaults(SamplingParams(temperature=0.9), frozenset({"temperature"}), qwen)
    assert (params.temperature, params.top_k, params.top_p) == (0.9, 20, 0.8)
    assert line == ("sampling: top_k 20, top_p 0.8 from the model's generation_config.json; -t 0 decodes greedily; "
                    "an option you set overrides its value")
    params, line = with_model_defaults(SamplingParams(), frozenset(), qwen)
    assert (params.temperature, params.top_k, params.top_p) == (0.7, 20, 0.8)
    llama = from_generation_config(_folder(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    assert with_model_defaults(SamplingParams(), frozenset(), llama)[1] == (
        "sampling: temperature 0.6, top_p 0.9 from the model's generation_config.json (top_k 50 by transformers' "
        "defaults); -t 0 decodes greedily; an option you set overrides its value")


def test_greedy_by_the_user_keeps_only_the_models_repetition_penalty(tmp_path):
    config = from_generation_config(_folder(tmp_path, {"do_sample": True, "top_k": 20, "repetition_penalty": 1.1}))
    params, line = with_model_defaults(SamplingParams(temperature=0.0), frozenset({"temperature"}), config)
    assert params == SamplingParams(repetition_penalty=1.1)
    assert line == "sampling: repetition_penalty 1.1 from the model's generation_config.json; an option you set " \
                   "overrides its value"
    assert with_model_defaults(SamplingParams(), frozenset(), NONE) == (SamplingParams(), None)


def test_a_bad_value_fails_only_where_it_applies(tmp_path):
    config = from_generation_config(_folder(tmp_path, {"do_sample": True, "top_p": 1.5, "top_k": 2.5}))
    with pytest.raises(MetraleError, match=r"generation_config.json top_p must be in \(0, 1\], got 1.5"):
        with_model_defaults(SamplingParams(), frozenset({"top_k"}), config)
    with pytest.raises(MetraleError, match="generation_config.json top_k must be an integer >= 0, got 2.5"):
        with_model_defaults(SamplingParams(), frozenset({"top_p"}), config)
    infinite = from_generation_config(_folder(tmp_path, {"do_sample": True, "top_k": float("inf")}))
    with pytest.raises(MetraleError, match="generation_config.json top_k must be an integer >= 0, got inf"):
        with_model_defaults(SamplingParams(), frozenset(), infinite)
    params, _ = with_model_defaults(SamplingParams(top_p=0.5, top_k=3), frozenset({"top_p", "top_k"}), config)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 0.5, 3)


def test_gguf_sampling_metadata_is_read_as_stored():
    meta = {"general.sampling.temp": np.float32(0.5), "general.sampling.top_k": np.int32(40),
            "general.sampling.min_p": np.float32(0.05), "general.name": "x"}
    params, line = with_model_defaults(SamplingParams(), frozenset(), from_gguf_metadata(meta))
    assert (params.temperature, params.top_k, params.min_p, params.top_p) == (0.5, 40, pytest.approx(0.05), 1.0)
    assert line.startswith("sampling: temperature 0.5, top_k 40, min_p 0.05 from the model's GGUF "
                           "general.sampling;")
    assert from_gguf_metadata({"general.name": "x"}) is NONE


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    folder = make_hf_checkpoint(tmp_path_factory.mktemp("sampled"), "qwen3")
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | {"do_sample": True, "temperature": 1.3,
                                                                        "top_k": 30, "top_p": 0.95}))
    return folder


def _run(*args):
    result = metrale("generate", "--no-chat-template", "-n", "12", "--ignore-eos", "--json", "--seed", "4", *args,
                     "Hello")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["results"][0]["token_ids"], result.stderr


def test_generate_samples_as_the_checkpoint_recommends(sampled, tmp_path):
    tokens, err = _run("-m", str(sampled))
    assert "sampling: temperature 1.3, top_k 30, top_p 0.95 from the model's generation_config.json" in err
    assert tokens == _run("-m", str(sampled), "-t", "1.3", "--top-k", "30", "--top-p", "0.95")[0]
    greedy, err = _run("-m", str(sampled), "-t", "0")
    assert "sampling:" not in err and greedy != tokens
    gguf_file = write_gguf(sampled, tmp_path / "s.gguf", sampling={"temp": 1.3, "top_k": 30, "top_p": 0.95})
    from_gguf, err = _run("-m", str(gguf_file))
    assert "sampling: temperature 1.3, top_k 30, top_p 0.95 from the model's GGUF general.sampling" in err
    assert from_gguf == _run("-m", str(gguf_file), "-t", "1.3", "--top-k", "30", "--top-p", "0.95")[0]


def test_chat_samples_as_the_checkpoint_recommends_and_says_so(sampled):
    turns = [metrale("chat", "-m", str(sampled), "-n", "8", "--json", "--seed", "2", *extra, stdin="hi\n")
             for extra in ([], ["-t", "1.3", "--top-k", "30", "--top-p", "0.95"], ["-t", "0"])]
    assert all(t.returncode == 0 for t in turns), turns[0].stderr
    assert "sampling: temperature 1.3, top_k 30, top_p 0.95 from the model's generation_config.json" in turns[0].stderr
    answers = [json.loads(t.stdout)["text"] for t in turns]
    assert answers[0] == answers[1] != answers[2] and "sampling:" not in turns[2].stderr
