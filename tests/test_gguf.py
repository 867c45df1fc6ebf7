"""GGUF: tiny files written from HF checkpoints round-trip; the embedded SmolLM2 loads right."""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch

from helpers_checkpoints import hf_state_dict, llama_cpp_permute, make_hf_checkpoint, write_gguf
from metrale_cli.checkpoint import (default_model_path, gguf_cache_path, gguf_io, load_checkpoint, read_config,
                                    read_tokenizer)
from metrale_cli.checkpoint import gguf_config
from metrale_cli.layers.spec import FfnSpec, MoeSpec
from metrale_cli.models import model_config
from metrale_cli.layers.rope import inv_freq_and_scaling
from metrale_cli.errors import MetraleError
from metrale_cli.checkpoint.tokenizer import Tokenizer

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_unpermute_inverts_llama_cpp_permutation():
    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    permuted = llama_cpp_permute(weight, 8)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(gguf_config.unpermute_qk(permuted, 8), weight)
    assert np.array_equal(gguf_config.permute_qk(weight, 8), permuted)
    # row order inside one head of dim 4: HF (0,1 | 2,3) <-> llama.cpp interleaved (0,2,1,3)
    assert gguf_config.permute_qk(np.arange(4), 1).tolist() == [0, 2, 1, 3]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_f32_gguf_round_trips_exactly(tmp_path, family):
    folder = make_hf_checkpoint(tmp_path, family)
    path = write_gguf(folder, tmp_path / f"{family}.gguf", "F32")
    ck = load_checkpoint(str(path), CPU, torch.float32)
    expected = hf_state_dict(folder)
    assert sorted(ck.tensors) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(ck.tensors[name], tensor.float()), name
    cache = gguf_cache_path(path)
    assert ck.source == f"{family} (gguf F32, {path}; dequantized now and cached in {cache} for the next start)"
    again = load_checkpoint(str(path), CPU, torch.float32)
    assert again.source == f"{family} (gguf F32, {path}; dequantized weights read from the cache {cache})"


def test_an_unwritable_gguf_cache_is_said_not_claimed(tmp_path, monkeypatch):
    """With METRALE_CACHE_DIR not writable the file converts every start, and the model line says
    so (it used to say the weights were cached there)."""
    folder = make_hf_checkpoint(tmp_path, "qwen3")
    path = write_gguf(folder, tmp_path / "q.gguf", "F32")
    monkeypatch.setenv("METRALE_CACHE_DIR", "/proc/metrale-cannot-write-here")
    said = []
    progress = lambda *args: None  # noqa: E731 (the progress callback; describe is what it says of the wait)
    progress.describe = said.append
    ck = load_checkpoint(str(path), CPU, torch.float32, progress)
    assert ck.source.endswith("is not writable, so every start converts again)")
    assert said == ["converting q.gguf (F32) to float32 safetensors: at every start (the cache is not writable)"]
    assert torch.equal(ck.tensors["model.norm.weight"], hf_state_dict(folder)["model.norm.weight"].float())


def test_gguf_config_matches_hf_config(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "qwen3", num_hidden_layers=3)
    hf = read_config(str(folder))
    config = read_config(str(write_gguf(folder, tmp_path / "q3.gguf")))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type", "architectures"):
        assert config[key] == hf[key], key
    assert config["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"])
    assert config["rope_theta"] == hf["rope_parameters"]["rope_theta"]
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_llama3_rope_freqs_give_the_frequencies_of_the_hf_config(tmp_path):
    """Llama 3.1 GGUFs carry llama3 RoPE scaling as rope_freqs.weight divisors, the metadata
    saying "default": the frequencies must still be the HF config's."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    folder = make_hf_checkpoint(tmp_path, "llama", rope_parameters=rope)
    gguf_rope = model_config(read_config(str(write_gguf(folder, tmp_path / "l3.gguf")))).layers[0].attention.rope
    hf_rope = model_config(read_config(str(folder))).layers[0].attention.rope
    assert gguf_rope.rope_type == "default" and hf_rope.rope_type == "llama3"
    assert len(set(gguf_rope.freq_factors)) == 4  # 1, 8 and two smoothed in between
    got, want = inv_freq_and_scaling(gguf_rope, 16, 256)[0], inv_freq_and_scaling(hf_rope, 16, 256)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    plain = inv_freq_and_scaling(replace(gguf_rope, freq_factors=None), 16, 256)[0]
    assert not torch.allclose(plain, want)  # dropping the tensor would be wrong RoPE
    with pytest.raises(MetraleError, match="rope_freqs has 8 factors; the rotary dimension 32 needs 16"):
        inv_freq_and_scaling(gguf_rope, 32, 256)


def _q8_0_error_ok(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Quantized (not equal) and within Q8_0's error: one scale per 32 values, half a step for
    rounding plus 127 times the fp16 rounding of the stored scale."""
    blocks = want.reshape(-1, 32)
    step = blocks.abs().amax(dim=1, keepdim=True) / 127
    error = (got.reshape(-1, 32) - blocks).abs()
    return bool((error <= step * (0.5 + 127 * 2.0**-11) + 1e-7).all()) and error.max() > 0


def test_q8_0_gguf_is_within_quantization_error(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "llama")
    ck = load_checkpoint(str(write_gguf(folder, tmp_path / "q8.gguf", "Q8_0")), CPU, torch.float32)
    assert "gguf Q8_0" in ck.source
    for name, tensor in hf_state_dict(folder).items():
        want, got = tensor.float(), ck.tensors[name]
        assert torch.equal(got, want) if want.dim() == 1 else _q8_0_error_ok(got, want), name


def test_q8_0_moe_experts_are_split_within_quantization_error(tmp_path):
    """Each expert's slice of the stacked Q8_0 tensors is its own weight; the router, which
    llama.cpp keeps in F32, is exact."""
    folder = make_hf_checkpoint(tmp_path, "qwen3_moe")
    ck = load_checkpoint(str(write_gguf(folder, tmp_path / "q8.gguf", "Q8_0")), CPU, torch.float32)
    expected = hf_state_dict(folder)
    experts = [name for name in expected if ".mlp.experts." in name]
    assert len(experts) == 2 * 6 * 3
    assert all(_q8_0_error_ok(ck.tensors[name], expected[name].float()) for name in experts)
    assert torch.equal(ck.tensors["model.layers.1.mlp.gate.weight"], expected["model.layers.1.mlp.gate.weight"].float())


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_a_moe_gguf_reads_as_its_hf_config(tmp_path, family):
    """Expert counts and widths from the metadata, llama.cpp's fixed renormalization: the same
    layers as the HF folder's config (eps aside: GGUF stores it in fp32)."""
    folder = make_hf_checkpoint(tmp_path, family, num_hidden_layers=3)
    hf = model_config(read_config(str(folder)))
    ours = model_config(read_config(str(write_gguf(folder, tmp_path / "m.gguf"))))
    assert [(s.attention, s.ffn) for s in ours.layers] == [(s.attention, s.ffn) for s in hf.layers]
    shared = 48 if family == "qwen2_moe" else 0
    assert ours.layers[2].ffn == FfnSpec("moe", 0, MoeSpec(6, 2, 32, family == "qwen3_moe", shared))


@pytest.mark.parametrize("family, key, lacking", [
    ("qwen3_moe", "moe_intermediate_size", "qwen3moe.expert_count"),  # the helper then writes no expert key
    ("qwen2_moe", "shared_expert_intermediate_size", "qwen2moe.expert_shared_feed_forward_length"),
])
def test_a_moe_gguf_without_its_expert_metadata_is_one_clear_error(tmp_path, family, key, lacking):
    folder = make_hf_checkpoint(tmp_path, family)
    config_path = folder / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {key: None}))
    with pytest.raises(MetraleError) as info:
        read_config(str(write_gguf(folder, tmp_path / "m.gguf")))
    assert info.value.message == f"GGUF metadata lacks {lacking}"


def test_a_squeezed_shared_expert_gate_is_restored(tmp_path):
    """Older llama.cpp converters squeezed every tensor: Qwen2-MoE's (1, H) shared-expert gate
    came out (H,); it loads as HF's (1, H)."""
    folder = make_hf_checkpoint(tmp_path, "qwen2_moe")
    path = write_gguf(folder, tmp_path / "sq.gguf", squeezed=True)
    assert gguf_io.tensor_shapes(gguf_io.open_reader(path))["blk.1.ffn_gate_inp_shexp.weight"] == (64,)
    ck = load_checkpoint(str(path), CPU, torch.float32)
    assert all(torch.equal(ck.tensors[n], t.float()) for n, t in hf_state_dict(folder).items())


def test_tied_embeddings_when_no_output_tensor(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    ck = load_checkpoint(str(write_gguf(folder, tmp_path / "tied.gguf")), CPU, torch.bfloat16)
    assert ck.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in ck.tensors
    assert ck.tensors["model.embed_tokens.weight"].shape == (320, 64)


def test_second_load_comes_from_the_cache(tmp_path, monkeypatch, cache_dir):
    folder = make_hf_checkpoint(tmp_path, "qwen2")
    path = write_gguf(folder, tmp_path / "c.gguf", "Q8_0")
    first = load_checkpoint(str(path), CPU, torch.bfloat16)
    cached = gguf_cache_path(path)
    assert cached.parent.parent == cache_dir
    assert (cached / "model.bfloat16.safetensors").is_file()

    def no_reader(_):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf_io, "open_reader", no_reader)
    second = load_checkpoint(str(path), CPU, torch.bfloat16)
    assert second.config == first.config
    assert first.source.endswith(f"dequantized now and cached in {cached} for the next start)")
    assert second.source.endswith(f"dequantized weights read from the cache {cached})")
    assert all(torch.equal(first.tensors[n], second.tensors[n]) for n in first.tensors)
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    os.utime(path, ns=(1, 1))
    assert gguf_cache_path(path) != cached  # an edited file is converted again


def test_conversion_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The cache file is written as tensors are converted: a model larger than host memory
    converts as long as its largest tensor fits."""
    folder = make_hf_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    path = write_gguf(folder, tmp_path / "s.gguf")
    alive, most = [], 0
    convert = gguf_io.convert_tensors

    def tracked(*args, **kwargs):
        nonlocal most
        for name, tensor in convert(*args, **kwargs):
            alive.append(weakref.ref(tensor))
            most = max(most, sum(r() is not None for r in alive))
            yield name, tensor

    monkeypatch.setattr(gguf_io, "convert_tensors", tracked)
    ck = load_checkpoint(str(path), CPU, torch.float32)
    assert len(alive) == len(ck.tensors) > 20 and most <= 2  # the one written and the one coming
    assert all(torch.equal(ck.tensors[n], t.float()) for n, t in hf_state_dict(folder).items())


def test_an_unwritable_cache_still_loads_the_model(tmp_path, cache_dir):
    folder = make_hf_checkpoint(tmp_path, "qwen2")
    path = write_gguf(folder, tmp_path / "u.gguf")
    cache_dir.write_text("a file where the cache folder should be")  # every write below fails
    ck = load_checkpoint(str(path), CPU, torch.float32)
    assert all(torch.equal(ck.tensors[n], t.float()) for n, t in hf_state_dict(folder).items())
    assert not gguf_cache_path(path).exists()


def test_a_corrupt_cached_config_is_rebuilt_from_the_file(tmp_path):
    """A cache entry whose config.json is not JSON was a traceback; the file's own metadata says."""
    path = write_gguf(make_hf_checkpoint(tmp_path, "llama"), tmp_path / "c.gguf")
    want = read_config(str(path))
    load_checkpoint(str(path), CPU, torch.float32)
    (gguf_cache_path(path) / "config.json").write_text("{not json")
    assert read_config(str(path)) == want
    ck = load_checkpoint(str(path), CPU, torch.float32)
    assert ck.source.endswith("for the next start)") and json.loads((gguf_cache_path(path) / "config.json").read_text())


def test_a_partial_rope_dimension_count_is_refused():
    meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
            "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.rope.dimension_count": 8}
    with pytest.raises(MetraleError) as info:
        gguf_config.synthesize_config(meta, {"token_embd.weight": (100, 64)})
    assert info.value.message == ("GGUF llama.rope.dimension_count 8 is not the head_dim 16: RoPE on part of each "
                                  "head is not built for GGUF files")
    whole = meta | {"llama.rope.dimension_count": 16}
    assert gguf_config.synthesize_config(whole, {"token_embd.weight": (100, 64)})["head_dim"] == 16


def test_truncated_gguf_is_one_clear_error(tmp_path):
    path = write_gguf(make_hf_checkpoint(tmp_path, "llama"), tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(MetraleError, match="truncated"):
        load_checkpoint(str(path), CPU, torch.bfloat16)


def test_wrong_tensor_shape_is_one_clear_error(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "llama")
    config_path = folder / "config.json"
    config_path.write_text(config_path.read_text().replace('"intermediate_size": 128', '"intermediate_size": 96'))
    with pytest.raises(MetraleError, match=r"blk\.0\.ffn_\w+\.weight has shape .*expected"):
        load_checkpoint(str(write_gguf(folder, tmp_path / "w.gguf")), CPU, torch.bfloat16)


def test_non_finite_weights_are_refused_naming_the_gguf_file(tmp_path, cache_dir):
    from safetensors.torch import load_file, save_file

    folder = make_hf_checkpoint(tmp_path, "llama")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"][3, :2] = torch.tensor([float("nan"), float("inf")])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    path = write_gguf(folder, tmp_path / "nan.gguf")
    cached, written = gguf_cache_path(path) / "model.bfloat16.safetensors", []
    for load in ("converted", "from the cache"):
        with pytest.raises(MetraleError) as info:
            load_checkpoint(str(path), CPU, torch.bfloat16)
        assert info.value.message == (f"{path}: tensor model.layers.0.mlp.up_proj.weight has 2 non-finite values "
                                      "(NaN or inf)"), load
        written.append(cached.stat().st_mtime_ns)
    assert written[0] == written[1]  # the cache is kept: converting again would not help


def _retype(path, name, ggml_type):
    """``path`` with tensor ``name`` declared as ``ggml_type``, its bytes left as they are."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    tensor.field.parts[4][0] = gguf.GGMLQuantizationType[ggml_type]  # the tensor info's type field
    reader.data.flush()


@pytest.mark.parametrize("ggml_type", ["I8", "I16", "I32", "I64", "F64"])
def test_a_type_the_conversion_does_not_dequantize_is_one_clear_error(tmp_path, cache_dir, ggml_type):
    path = write_gguf(make_hf_checkpoint(tmp_path, "llama"), tmp_path / "t.gguf")
    _retype(path, "blk.0.ffn_up.weight", ggml_type)
    with pytest.raises(MetraleError) as info:
        load_checkpoint(str(path), CPU, torch.bfloat16)
    assert info.value.message == (f"GGUF tensor blk.0.ffn_up.weight is stored as {ggml_type}, a type metrale "
                                  "does not dequantize")
    assert "llama-quantize" in info.value.hint
    assert not list(cache_dir.rglob("*.safetensors*"))  # refused before any tensor was converted


def test_the_dequantized_types_are_those_the_gguf_package_dequantizes():
    import gguf

    for ggml_type in gguf.GGMLQuantizationType:
        block, size = gguf.GGML_QUANT_SIZES[ggml_type]
        try:
            values = gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), ggml_type)
        except NotImplementedError:
            assert ggml_type.name not in gguf_io.DEQUANTIZED
        else:
            assert ggml_type.name in gguf_io.DEQUANTIZED and values.shape == (1, block)


def test_unsupported_architecture(tmp_path):
    with pytest.raises(MetraleError, match="architecture 'mamba' is not supported"):
        gguf_config.synthesize_config({"general.architecture": "mamba"}, {})


def test_every_table_row_maps_back_and_forth():
    for part, hf_part in gguf_config.LAYER_NAMES.items():
        assert gguf_config.hf_name(f"blk.7.{part}.weight") == f"model.layers.7.{hf_part}.weight"
    for part, hf_part in gguf_config.GLOBAL_NAMES.items():
        assert gguf_config.hf_name(f"{part}.weight") == f"{hf_part}.weight"
    assert gguf_config.hf_name("rope_freqs.weight") is None
    for part, hf_part in gguf_config.EXPERT_NAMES.items():
        assert gguf_config.hf_tensors(f"blk.7.{part}.weight", (3, 8, 4)) == [
            (f"model.layers.7.mlp.experts.{e}.{hf_part}.weight", e) for e in range(3)]
    assert gguf_config.hf_tensors("blk.7.ffn_gate_inp.weight", (3, 4)) == [("model.layers.7.mlp.gate.weight", None)]
    assert gguf_config.hf_tensors("rope_freqs.weight", (8,)) == []
    with pytest.raises(MetraleError, match="no HF equivalent"):
        gguf_config.hf_name("blk.0.ssm_conv1d.weight")


def test_gguf_tokenizer_matches_the_hf_folder_tokenizer(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "llama")
    from_gguf = load_checkpoint(str(write_gguf(folder, tmp_path / "tok.gguf")), CPU, torch.bfloat16).tokenizer
    from_folder = Tokenizer.from_hf_folder(folder)
    for text in ["Hello world!", "Café naïve 日本語 🤖 12345", "<|im_start|>user\nhi<|im_end|>"]:
        assert from_gguf.encode(text) == from_folder.encode(text)
    messages = [{"role": "user", "content": "Hello there"}]
    assert from_gguf.apply_chat_template(messages) == from_folder.apply_chat_template(messages)
    assert from_gguf.eos_token_ids == from_folder.eos_token_ids
    assert from_gguf.bos_token_id == from_folder.bos_token_id


def test_the_tokenizer_reads_without_tensors_before_and_after_conversion(tmp_path, monkeypatch):
    folder = make_hf_checkpoint(tmp_path, "llama")
    path = write_gguf(folder, tmp_path / "r.gguf")
    from_folder = Tokenizer.from_hf_folder(folder)

    def no_tensors(*_args, **_kwargs):
        raise AssertionError("tensors were read")

    with monkeypatch.context() as m:
        m.setattr(gguf_io, "convert_tensors", no_tensors)
        before = read_tokenizer(str(path))  # from the file's metadata
    load_checkpoint(str(path), CPU, torch.bfloat16)
    monkeypatch.setattr(gguf_io, "open_reader", no_tensors)
    after = read_tokenizer(str(path))  # from the conversion cache, the file not opened
    for tok in (before, after):
        assert tok.encode("Café naïve 🤖 12345") == from_folder.encode("Café naïve 🤖 12345")
        assert tok.eos_token_ids == from_folder.eos_token_ids


def test_a_special_token_id_past_the_vocabulary_is_one_error_naming_the_key(tmp_path):
    """The file's eos id past its token list (which had raised IndexError) is refused before a
    weight is read."""
    import gguf

    from metrale_cli.engine.runner import RunnerOptions, open_runner
    from metrale_cli.engine.source import ModelSource

    path = write_gguf(make_hf_checkpoint(tmp_path, "qwen3"), tmp_path / "eos.gguf")
    field = gguf.GGUFReader(str(path), "r+").fields["tokenizer.ggml.eos_token_id"]
    field.parts[field.data[0]][0] = 100000
    source = ModelSource.checkpoint(str(path))
    source = ModelSource(source.config, source.tokenizer, lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(MetraleError) as info:
        open_runner(RunnerOptions(backend="torch"), source)
    assert info.value.message == ("GGUF tokenizer.ggml.eos_token_id 100000 is past the token list "
                                  "(tokenizer.ggml.tokens holds 320)")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny llama GGUF file that the tests below copy with one metadata key changed."""
    folder = tmp_path_factory.mktemp("tiny-gguf")
    return write_gguf(make_hf_checkpoint(folder, "llama"), folder / "tiny.gguf")


def _with_metadata(path, out, changes: dict):
    """A copy of the GGUF file ``path`` with these metadata keys set, each value typed as the gguf
    package types a python value (a str is STRING, an int INT32, a list an ARRAY of its items')."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture" and name not in changes:
            writer.add_key_value(name, field.contents(), field.types[0],
                                 sub_type=field.types[-1] if len(field.types) > 1 else None)
    for key, value in changes.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


PAST = "is past the token list (tokenizer.ggml.tokens holds 320)"


@pytest.mark.parametrize("changes, message", [
    ({"tokenizer.chat_template": 5}, "GGUF tokenizer.chat_template is 5, not the template's text"),
    ({"tokenizer.ggml.bos_token_id": 99999}, f"GGUF tokenizer.ggml.bos_token_id 99999 {PAST}"),
    ({"tokenizer.ggml.bos_token_id": 99999, "tokenizer.ggml.add_bos_token": True},
     f"GGUF tokenizer.ggml.bos_token_id 99999 {PAST}"),
    ({"tokenizer.ggml.eos_token_id": 99999}, f"GGUF tokenizer.ggml.eos_token_id 99999 {PAST}"),
    ({"tokenizer.ggml.merges": ["abc", "x y"]}, "GGUF tokenizer.ggml.merges[0] is 'abc', not two tokens joined by "
                                                "a space"),
    ({"tokenizer.ggml.merges": [1, 2]}, "GGUF tokenizer.ggml.merges[0] is 1, not a string"),
    ({"tokenizer.ggml.tokens": [1, 2, 3]}, "GGUF tokenizer.ggml.tokens[0] is 1, not a string"),
    ({"tokenizer.ggml.tokens": ["a", "b", "c"]}, "GGUF tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: "
                                                 "Error while initializing BPE: Token `Ġ` out of vocabulary"),
    ({"tokenizer.ggml.token_type": ["a"]}, "GGUF tokenizer.ggml.token_type[0] is 'a', not an integer"),
    ({"tokenizer.ggml.pre": [1]}, "GGUF pre-tokenizer [1] is not supported"),
])
def test_a_gguf_tokenizer_key_that_cannot_be_read_is_one_error_naming_it(tiny_gguf, tmp_path, changes, message):
    """Read from the file's metadata: not a TypeError, IndexError or the tokenizers library's own
    exception from building the tokenizer."""
    path = _with_metadata(tiny_gguf, tmp_path / "changed.gguf", changes)
    with pytest.raises(MetraleError) as info:
        read_tokenizer(str(path))
    assert info.value.message == message


@pytest.mark.parametrize("read", [lambda path: read_config(str(path)), lambda path: read_tokenizer(str(path)),
                                  lambda path: load_checkpoint(str(path), CPU, torch.float32)],
                         ids=["config", "tokenizer", "load"])
def test_a_metadata_string_that_is_not_utf8_is_one_error_naming_its_key(tiny_gguf, tmp_path, read):
    """One flipped byte in the chat template's text: not a UnicodeDecodeError from the gguf package."""
    data = bytearray(tiny_gguf.read_bytes())
    data[data.index(b"{% for message in messages %}")] = 0xFF
    path = tmp_path / "flipped.gguf"
    path.write_bytes(data)
    with pytest.raises(MetraleError) as info:
        read(path)
    assert info.value.message.startswith("the GGUF file's metadata is corrupt: tokenizer.chat_template is not UTF-8 "
                                         "text ('utf-8' codec can't decode byte 0xff in position 0")
    assert info.value.hint == "re-download the file"


# --- the embedded default: SmolLM2-135M-Instruct Q4_1 -------------------------------------

@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    old = os.environ.get("METRALE_CACHE_DIR")
    os.environ["METRALE_CACHE_DIR"] = str(tmp_path_factory.mktemp("smollm-cache"))
    try:
        yield load_checkpoint(None, CPU, torch.float32)
    finally:
        os.environ.pop("METRALE_CACHE_DIR") if old is None else os.environ.update(METRALE_CACHE_DIR=old)


def test_embedded_default_config(smollm):
    c = smollm.config
    assert (c["model_type"], c["num_hidden_layers"], c["hidden_size"]) == ("llama", 30, 576)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert (c["vocab_size"], c["intermediate_size"], c["tie_word_embeddings"]) == (49152, 1536, True)
    assert (c["rope_theta"], c["max_position_embeddings"]) == (100000.0, 8192)
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert smollm.source.startswith("SmolLM2-135M-Instruct (gguf Q4_1, ")
    assert len(smollm.tensors) == 1 + 1 + 30 * 9 and "lm_head.weight" not in smollm.tensors
    assert smollm.tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert smollm.tensors["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)


def test_embedded_default_unpermutes_like_transformers(smollm):
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = gguf_io.open_reader(default_model_path())
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    wanted = {"blk.3.attn_q.weight": "model.layers.3.self_attn.q_proj.weight",
              "blk.3.attn_k.weight": "model.layers.3.self_attn.k_proj.weight",
              "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight"}
    for tensor in reader.tensors:
        if tensor.name in wanted:
            reference = processor.process(dequantize(tensor.data, tensor.tensor_type), tensor.name).weights
            assert torch.equal(smollm.tensors[wanted[tensor.name]], torch.from_numpy(np.array(reference)))


def test_embedded_default_tokenizer_matches_transformers(smollm):
    from transformers import AutoTokenizer

    path = default_model_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = smollm.tokenizer
    texts = ["Hello world!", "Café naïve 日本語 🤖 12345", "  two  spaces\n\nnew line\ttab",
             "def f(x):\n    return x**2  # square", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    assert tok.encode("Hello world!") == [19556, 905, 17]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages)
    assert prompt == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode(prompt, add_special_tokens=False)[:2] == [1, 9690]
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, [2, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (an H200)")
def test_gguf_loads_to_the_gpu_from_conversion_and_from_cache(tmp_path):
    pytest.importorskip("gguf", reason="the gguf package is not installed on this GPU machine")
    folder = make_hf_checkpoint(tmp_path, "llama")
    path = write_gguf(folder, tmp_path / "gpu.gguf")
    for _ in range(2):  # first converts, second reads the cache
        ck = load_checkpoint(str(path), torch.device("cuda"), torch.bfloat16)
        assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in ck.tensors.values())
        assert torch.equal(ck.tensors["lm_head.weight"].cpu(), hf_state_dict(folder)["lm_head.weight"])


# --- SentencePiece (tokenizer.ggml.model "llama": Llama 2, Mistral, ...) ---------------------

def _spm_vocab():
    """A small SentencePiece vocabulary as llama.cpp stores it: control and unknown tokens, the
    256 byte-fallback pieces, then scored pieces (higher score = merged first)."""
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [6] * 256
    pieces = ["▁", "e", "t", "a", "o", "i", "n", "h", "s", "r", "d", "l", "u", "c", "m", "w", "f", "g", "y",
              "p", "b", ",", ".", "T", "H", "é", "th", "▁t", "he", "▁the", "in", "▁a", "er", "an", "on", "▁th",
              "re", "at", "en", "nd", "▁w", "▁s", "ing", "▁in", "▁of", "ed", "▁The", "or", "es", "is", "▁an",
              "▁and", "it", "ou", "ar", "▁h", "▁he", "▁wh", "▁whe", "▁when", "ion", "ll", "▁c", "▁ca", "▁cat",
              "▁sat"]
    tokens += pieces
    scores += [-0.5 * i - (1.0 if len(p) > 2 else 0.0) for i, p in enumerate(pieces)]
    types += [1] * len(pieces)
    return tokens, scores, types


SPM_TEXTS = ["The cat sat when the hen ate.", "  the  end", "héllo 日本 wörld\n\tok", "When, then? in and of", ""]


def test_sentencepiece_gguf_tokenizes_as_transformers_converts_it(tmp_path):
    from transformers.integrations.ggml import GGUFLlamaConverter
    import gguf

    tokens, scores, types = _spm_vocab()
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = read_tokenizer(str(path))
    theirs = GGUFLlamaConverter({"tokens": tokens, "scores": scores, "token_type": types, "bos_token_id": 1,
                                 "eos_token_id": 2, "unk_token_id": 0}).converted()
    for text in SPM_TEXTS:
        ids = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.encode("The cat")[:1] == [1]  # llama.cpp puts BOS first in SentencePiece vocabularies
    assert 2 in ours.eos_token_ids
    byte_pieces = ours.encode("日", add_special_tokens=False)
    assert [tokens[i] for i in byte_pieces] == ["▁", "<0xE6>", "<0x97>", "<0xA5>"]  # byte fallback


def test_the_first_start_of_a_gguf_says_it_is_converting(tmp_path):
    """The command line's progress callback: a line while a GGUF converts, none once it is cached."""
    import subprocess
    import sys

    folder = make_hf_checkpoint(tmp_path, "qwen3")
    path = write_gguf(folder, tmp_path / "q.gguf", "F32")
    env = {**os.environ, "METRALE_CACHE_DIR": str(tmp_path / "cache")}
    args = [sys.executable, "-m", "metrale_cli", "generate", "-m", str(path), "--no-chat-template", "-n", "2", "hi"]
    runs = [subprocess.run(args, capture_output=True, text=True, env=env, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert "converting q.gguf (F32) to bfloat16 safetensors: once, then read from the cache" in runs[0].stderr
    assert "converting" not in runs[1].stderr


QWEN3MOE_META = {"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 64,
                 "qwen3moe.feed_forward_length": 96, "qwen3moe.block_count": 2, "qwen3moe.attention.head_count": 4,
                 "qwen3moe.attention.head_count_kv": 2, "qwen3moe.attention.key_length": 16,
                 "qwen3moe.expert_count": 6, "qwen3moe.expert_used_count": 2,
                 "qwen3moe.expert_feed_forward_length": 32}


@pytest.mark.parametrize("change, message", [
    ({"qwen3moe.expert_count": 0}, "GGUF metadata qwen3moe.expert_count must be a positive integer, got 0"),
    ({"qwen3moe.expert_used_count": 7}, "GGUF metadata num_experts_per_tok (7) exceeds num_experts (6)"),
    ({"qwen3moe.rope.scaling.type": "longrope"}, "GGUF metadata rope_type 'longrope' is not supported"),
    ({"qwen3moe.attention.layer_norm_rms_epsilon": -1.0},
     "GGUF metadata qwen3moe.attention.layer_norm_rms_epsilon must be a positive number, got -1.0"),
    ({"qwen3moe.rope.freq_base": 0.0}, "GGUF metadata qwen3moe.rope.freq_base must be a positive number, got 0.0"),
    ({"qwen3moe.attention.key_length": 0},
     "GGUF metadata qwen3moe.attention.key_length must be a positive integer, got 0"),
    ({"qwen3moe.rope.scaling.type": "yarn", "qwen3moe.rope.scaling.factor": float("inf")},
     "GGUF metadata (as config key 'factor') must be a finite number, got inf"),
])
def test_a_metadata_value_the_family_refuses_is_named_as_the_files(change, message):
    """The family's checks speak of config.json; read from a GGUF, the line names its metadata."""
    assert gguf_config.synthesize_config(QWEN3MOE_META, {"token_embd.weight": (100, 64)})["num_experts"] == 6
    with pytest.raises(MetraleError) as info:
        gguf_config.synthesize_config(QWEN3MOE_META | change, {"token_embd.weight": (100, 64)})
    assert info.value.message == message
