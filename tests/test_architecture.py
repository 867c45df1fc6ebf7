"""The architecture's contracts: families in one table, a LayerSpec per layer (its fields served
or refused, never ignored), layers with their own shapes in one stack, decisions made once, the
per-sequence layer states, and an import graph whose layers only point down."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F
import transformers as T
from typer.testing import CliRunner

from metrale_cli.checkpoint import gguf_config
from metrale_cli.cli import app
from metrale_cli.config import ConfigReader
from metrale_cli.engine.generate import Engine
from metrale_cli.engine.runner import RunnerOptions, open_runner
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.engine.source import ModelSource
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.layers.spec import UNSERVED, check_served, unserved
from metrale_cli.layers.parallel import SINGLE, TensorParallel
from helpers_checkpoints import FAMILIES as CHECKPOINT_FAMILIES, TINY
from metrale_cli.models import FAMILIES, build_model, family_of, hold_once, model_config
from metrale_cli.models.sharding import Sharder, shard_config

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "metrale_cli"
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256}


# --- families -------------------------------------------------------------------------------------
def test_an_unsupported_model_type_names_every_supported_family():
    with pytest.raises(MetraleError) as info:
        model_config(LLAMA | {"model_type": "mamba"})
    assert info.value.message == "model_type 'mamba' is not supported yet"
    assert info.value.hint == "supported families: " + ", ".join(FAMILIES) == (
        "supported families: llama, mistral, phi3, qwen2, qwen3, qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_text, "
        "qwen3_5_moe_text, qwen3_5, qwen3_5_moe")


@pytest.mark.parametrize("model_type", [["llama"], {"name": "llama"}, 3])
def test_a_model_type_that_is_not_a_string_is_one_error_naming_it(model_type):
    with pytest.raises(MetraleError) as info:
        model_config(LLAMA | {"model_type": model_type})
    assert info.value.message == f"config.json key 'model_type' must be a string, got {model_type!r}"
    assert info.value.hint.startswith("supported families: llama, mistral")


def test_the_gguf_architectures_are_the_families():
    assert gguf_config.architectures() == {f.gguf.name: f for f in FAMILIES.values() if f.gguf is not None}
    with pytest.raises(MetraleError) as info:
        gguf_config.arch_of("mamba")
    assert info.value.hint == "supported: llama, qwen2, qwen3, qwen2moe, qwen3moe"
    assert family_of("llama").gguf.permuted_qk and family_of("qwen2").gguf.attention_bias


@pytest.mark.parametrize("family, overrides, qkv_bias, qk_norm, head_dim", [
    ("llama", {}, False, False, 16),
    ("llama", {"attention_bias": True, "head_dim": 32}, True, False, 32),  # head_dim != hidden / heads
    ("qwen2", {}, True, False, 16),
    ("qwen3", {"head_dim": 24}, False, True, 24),
])
def test_layer_specs_are_read_as_the_family_says(family, overrides, qkv_bias, qk_norm, head_dim):
    raw = getattr(T, {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[family])(
        **(LLAMA | overrides | {"model_type": family})).to_dict()
    cfg = model_config(raw)
    assert cfg.num_layers == 3 and [s.index for s in cfg.layers] == [0, 1, 2]
    a = cfg.layers[0].attention
    assert (a.head_dim, a.num_heads, a.num_kv_heads, a.qkv_bias, a.qk_norm) == (head_dim, 4, 2, qkv_bias, qk_norm)
    assert a.scale == head_dim**-0.5 and a.sliding_window is None and cfg.layers[0].ffn.intermediate_size == 96
    assert unserved(cfg.layers) == []


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_sliding_window_is_refused_on_the_layers_transformers_gives_it(family, tmp_path):
    """Qwen2 / Qwen3 with use_sliding_window: transformers puts the window on the layers from
    max_window_layers on; no kernel applies a window yet, so the run refuses them in one line
    (before, it ran full attention silently)."""
    cls = {"qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config}[family]
    raw = cls(**(LLAMA | {"model_type": family, "use_sliding_window": True, "sliding_window": 64,
                          "max_window_layers": 1})).to_dict()
    cfg = model_config(raw)
    assert [s.attention.sliding_window for s in cfg.layers] == [None, 64, 64]
    assert [t == "sliding_attention" for t in raw["layer_types"]] == [False, True, True]
    with pytest.raises(MetraleError) as info:
        open_runner(RunnerOptions(backend="torch"), ModelSource(raw, lambda: None, lambda *a: pytest.fail("loaded")))
    assert "layer 1 (and 1 more): sliding_window = 64: no attention kernel applies a sliding window" in info.value.message
    no_window = cls(**(LLAMA | {"model_type": family, "sliding_window": 64})).to_dict()  # use_sliding_window off
    assert all(s.attention.sliding_window is None for s in model_config(no_window).layers)


QWEN3_WINDOWED = {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 4}


@pytest.mark.parametrize("overrides, message", [
    ({"layer_types": 5}, "config.json layer_types must list 3 layer types, got 5"),
    ({"layer_types": "full_attention"}, "config.json layer_types must list 3 layer types, got 'full_attention'"),
    ({"layer_types": [["a"], "full_attention", "full_attention"]},
     "config.json layer_types names \"['a']\", not a layer type this family has"),
    ({"max_window_layers": "1"}, "config.json key 'max_window_layers' must be a non-negative integer, got '1'"),
    ({"max_window_layers": [1]}, "config.json key 'max_window_layers' must be a non-negative integer, got [1]"),
    ({"max_window_layers": -1}, "config.json key 'max_window_layers' must be a non-negative integer, got -1"),
])
def test_layer_types_or_max_window_layers_of_the_wrong_kind_are_one_error(overrides, message):
    """Qwen2 / Qwen3 read layer_types as one known type per layer, else max_window_layers as a
    layer count: a number, a string or a list in their place was a TypeError."""
    with pytest.raises(MetraleError) as info:
        model_config(LLAMA | QWEN3_WINDOWED | overrides)
    assert info.value.message == message


def test_mistrals_window_is_on_every_layer_as_transformers_masks_it():
    """transformers' MistralModel masks every layer with ``sliding_window`` (4096 by default, as
    Mistral 7B v0.1 has it): refused on all of them; v0.2 on, Nemo and Small set none and run."""
    windowed = T.MistralConfig(**(LLAMA | {"model_type": "mistral"})).to_dict()
    assert windowed["sliding_window"] == 4096
    assert [s.attention.sliding_window for s in model_config(windowed).layers] == [4096] * 3
    assert unserved(model_config(windowed).layers) == [
        "layer 0 (and 2 more): sliding_window = 4096: no attention kernel applies a sliding window yet (with "
        "--max-seq-len 4096 or less the window masks nothing, and the model runs)"]
    nemo = T.MistralConfig(**(LLAMA | {"model_type": "mistral", "sliding_window": None, "head_dim": 32})).to_dict()
    cfg = model_config(nemo)
    assert cfg.family == "mistral" and unserved(cfg.layers) == []
    a = cfg.layers[0].attention
    assert (a.head_dim, a.num_heads, a.num_kv_heads, a.qkv_bias, a.qk_norm, a.o_bias) == (32, 4, 2, False, False, False)
    biased = model_config(nemo | {"attention_bias": True}).layers[0].attention  # MistralAttention builds none
    assert (biased.qkv_bias, biased.o_bias) == (False, False)


def test_phi3_is_read_with_its_fused_tensors_and_partial_rope():
    """Phi-3 / Phi-4: the checkpoint holds qkv_proj and gate_up_proj, as transformers does; RoPE on
    partial_rotary_factor of each head; the 128k models' longrope scaling is refused in one line."""
    from metrale_cli.models import family_of

    raw = T.Phi3Config(**(LLAMA | {"model_type": "phi3", "partial_rotary_factor": 0.75,
                                   "pad_token_id": None})).to_dict()  # its default pads with 32000
    cfg = model_config(raw)
    a = cfg.layers[0].attention
    assert cfg.family == "phi3" and unserved(cfg.layers) == [] and a.rope.partial_rotary_factor == 0.75
    shapes = family_of("phi3").expected_tensors(cfg)
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (16 * 4 + 2 * 16 * 2, 64)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 96, 64)
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in shapes)
    longrope = dict(raw, rope_parameters=None, rope_scaling={  # as Phi-3-mini-128k's config.json spells it
        "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    with pytest.raises(MetraleError) as info:
        model_config(longrope)
    assert info.value.message == "config.json rope_type 'longrope' is not supported for phi3"


@pytest.mark.parametrize("scaling", [{"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
                                     {"type": "yarn", "factor": 2.0}, {"type": "linear", "factor": 2.0}])
def test_phi3_refuses_every_rope_scaling(scaling):
    """transformers' Phi-3 reads 'su' and 'yarn' as longrope and refuses any other type; metrale ran
    'yarn' as YaRN and 'linear' as linear scaling, output transformers never gives."""
    raw = LLAMA | {"model_type": "phi3", "rope_scaling": scaling}
    with pytest.raises(MetraleError) as info:
        model_config(raw)
    assert info.value.message == f"config.json rope_type '{scaling['type']}' is not supported for phi3"
    assert info.value.hint.startswith("Phi-3 reads 'su' and 'yarn' as longrope")


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "linear"}, "config.json rope_type 'linear' needs 'factor', which the config does not give"),
    ({"rope_type": "yarn"}, "config.json rope_type 'yarn' needs 'factor', which the config does not give"),
    ({**LLAMA3, "low_freq_factor": None}, "config.json rope_type 'llama3' needs 'low_freq_factor', which the config "
     "does not give"),
    ({**LLAMA3, "factor": "8"}, "config.json key 'factor' must be a number, got '8'"),
    ({**LLAMA3, "factor": 0}, "config.json RoPE key 'factor' must be positive, got 0"),
    ({**LLAMA3, "low_freq_factor": 0}, "config.json RoPE key 'low_freq_factor' must be positive, got 0"),
    ({**LLAMA3, "original_max_position_embeddings": 0},
     "config.json RoPE key 'original_max_position_embeddings' must be positive, got 0"),
    ({**LLAMA3, "low_freq_factor": 4.0}, "config.json RoPE high_freq_factor (4.0) must be greater than "
     "low_freq_factor (4.0)"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": "x"}, "config.json key 'beta_fast' must be a number, got 'x'"),
    ({**LLAMA3, "factor": 1e999}, "config.json key 'factor' must be a finite number, got inf"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "x"},
     "config.json key 'truncate' must be true or false, got 'x'"),
    ({"rope_type": "default", "freq_factors": ["a"]}, "config.json key 'freq_factors' must be a number, got 'a'"),
    ({"rope_type": "default", "freq_factors": 5},
     "config.json key 'freq_factors' must be a list of positive numbers, got 5"),
    ({"rope_type": "default", "freq_factors": [1.0] * 7 + [0.0]},
     "config.json key 'freq_factors' must be a positive number, got 0.0"),
    ({"rope_type": "default", "freq_factors": [1.0] * 7 + [float("nan")]},
     "config.json key 'freq_factors' must be a finite number, got nan"),
    ({"rope_type": "default", "freq_factors": [1.0] * 4},  # head_dim 16: 8 rotated pairs
     "config.json RoPE freq_factors has 4 entries; the rotary dimension 16 of head_dim 16 needs 8"),
])
def test_a_scaled_rope_missing_a_key_or_with_a_bad_value_is_one_error(scaling, message):
    """A missing factor ran as 1.0 (no scaling), a string or zero was a traceback, a zero
    original_max_position_embeddings ran as max_position_embeddings; an infinite factor or a
    freq_factor of zero gave NaN logits."""
    with pytest.raises(MetraleError) as info:
        model_config(LLAMA | {"rope_scaling": {k: v for k, v in scaling.items() if v is not None}})
    assert info.value.message == message


@pytest.mark.parametrize("family, factor, message", [
    ("phi3", -0.5, "config.json partial_rotary_factor must be in (0, 1], got -0.5"),
    ("phi3", 2.0, "config.json partial_rotary_factor must be in (0, 1], got 2.0"),
    ("llama", 0.5, "config.json partial_rotary_factor=0.5 is not supported for llama"),
    ("qwen3", 0.5, "config.json partial_rotary_factor=0.5 is not supported for qwen3"),
])
def test_a_partial_rotary_factor_that_is_not_run_as_transformers_runs_it_is_refused(family, factor, message):
    """Out of (0, 1] it was a traceback; transformers' Llama / Mistral / Qwen2 / Qwen3 rotate the
    whole head whatever the key says, where metrale rotated part of it."""
    with pytest.raises(MetraleError) as info:
        model_config(LLAMA | {"model_type": family, "partial_rotary_factor": factor})
    assert info.value.message == message


@pytest.mark.parametrize("family, overrides", [("mistral", {"sliding_window": "4096"}), ("phi3", {"sliding_window": 0}),
                                               ("qwen2", {"use_sliding_window": True, "sliding_window": 1.5})])
def test_a_sliding_window_that_is_no_positive_integer_is_one_error(family, overrides):
    with pytest.raises(MetraleError) as info:
        model_config(LLAMA | {"model_type": family} | overrides)
    assert info.value.message == (f"config.json key 'sliding_window' must be a positive integer, "
                                  f"got {overrides['sliding_window']!r}")


def test_a_tied_model_with_an_lm_head_of_its_own_is_refused():
    """transformers 5 runs such a checkpoint untied (4 ties the head away): metrale tied it, output
    of neither; a stored copy of the embedding still loads."""
    from hf_oracle import make_hf, ours, planned

    hf, raw = make_hf("llama", tie_word_embeddings=True)
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    assert ours(hf, raw).model.lm_head.shape == (384, 64)  # the head as a copy of the embedding
    weights["lm_head.weight"] += 1.0
    with pytest.raises(MetraleError) as info:
        build_model(planned(raw), weights, TorchOps(), 64, 512, 0, torch.device("cpu"))
    assert info.value.message == ("config.json sets tie_word_embeddings, but the checkpoint's lm_head.weight is not "
                                  "a copy of model.embed_tokens.weight")


def test_the_mistral_nemo_preset_reads_as_its_model():
    """bench's mistral-nemo-12b: head_dim 128 where hidden / heads is 160, no window, 12.25 B weights
    (24.5 GB in bf16, as its comment says)."""
    from metrale_cli.commands.bench_presets import PRESETS
    from metrale_cli.engine.room import weight_bytes

    cfg = model_config(PRESETS["mistral-nemo-12b"])
    a = cfg.layers[0].attention
    assert cfg.family == "mistral" and cfg.num_layers == 40 and unserved(cfg.layers) == []
    assert (a.head_dim, a.num_heads, a.num_kv_heads, a.q_size, a.kv_size) == (128, 32, 8, 4096, 1024)
    assert round(weight_bytes(cfg, torch.bfloat16) / 1e9, 1) == 24.5


def test_a_window_at_least_the_context_masks_nothing_so_the_model_runs():
    """A sliding window as long as the run's context masks no key (a query at position p sees the
    keys after p - window, and p < context), so full attention is exact there: the run opens, and
    its fp32 greedy tokens are HF's, which applies the window. One token more of context and the
    model is refused, its line naming the --max-seq-len that runs it."""
    from hf_oracle import hf_greedy, hf_kv_rounded_to_bf16, make_hf, random_ids

    hf, raw = make_hf("mistral", sliding_window=48, head_dim=24)
    layers = model_config(raw).layers
    assert unserved(layers, 48) == [] and unserved(layers, None) != []
    assert unserved(layers, 49) == ["layer 0 (and 2 more): sliding_window = 48: no attention kernel applies a "
                                    "sliding window yet (with --max-seq-len 48 or less the window masks nothing, "
                                    "and the model runs)"]
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}

    def opened(context):
        return open_runner(RunnerOptions(backend="torch", dtype="fp32", max_seq_len=context, max_num_seqs=1,
                                         reserve_all_memory=False, prefill_chunk=7),
                           ModelSource.loaded(raw, dict(weights), None, "mistral"))

    with pytest.raises(MetraleError) as info:
        opened(49)
    assert "sliding_window = 48" in info.value.message and "--max-seq-len 48 or less" in info.value.message
    prompt = random_ids(16, seed=5)
    with hf_kv_rounded_to_bf16():
        want, _ = hf_greedy(hf, prompt, 32)
    seqs, _ = opened(48).engine.generate([prompt], SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert seqs[0].output_ids == want


def test_a_sliding_window_checkpoint_is_one_error_line_on_the_command_line(tmp_path):
    from helpers_checkpoints import make_hf_checkpoint

    folder = make_hf_checkpoint(tmp_path, "qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=0)
    result = CliRunner().invoke(app, ["generate", "-m", str(folder), "--backend", "torch", "hi"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "layer 0 (and 1 more): sliding_window = 32" in lines[0]
    assert "--max-seq-len 32 or less" in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("rule", UNSERVED, ids=lambda r: r.path)
def test_every_field_nothing_serves_is_refused_naming_layer_and_field(rule):
    cfg = model_config(LLAMA)
    path = rule.path.split(".")
    value = {"mixer": "mla", "ffn.kind": "moe", "attention.sliding_window": 128, "layer_scalar": 0.5}.get(rule.path, True)

    def with_value(spec):
        if len(path) == 1:
            return dataclasses.replace(spec, **{path[0]: value})
        inner = getattr(spec, path[0])
        if len(path) == 3:
            leaf = dataclasses.replace(getattr(inner, path[1]), **{path[2]: value})
            return dataclasses.replace(spec, **{path[0]: dataclasses.replace(inner, **{path[1]: leaf})})
        return dataclasses.replace(spec, **{path[0]: dataclasses.replace(inner, **{path[1]: value})})

    layers = (cfg.layers[0], with_value(cfg.layers[1]), cfg.layers[2])
    with pytest.raises(MetraleError) as info:
        check_served(layers)
    assert f"layer 1: {path[-1]} = {value!r}: {rule.why.format(value=value)}" in info.value.message


# --- layers of their own shapes in one stack --------------------------------------------------------
def _reference_forward(cfg, w, ids):
    """The stack in plain fp32 torch from the checkpoint's tensors: each layer with its own heads,
    head_dim and RoPE (rotate-half), GQA, causal softmax attention, SwiGLU; K and V rounded to
    bf16 as the bf16 cache stores them."""
    def norm(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * g.float()

    h = w["model.embed_tokens.weight"].float()[ids]
    t = len(ids)
    for spec in cfg.layers:
        a, p = spec.attention, f"model.layers.{spec.index}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q, k, v = (F.linear(x, w[p + f"self_attn.{n}_proj.weight"].float()).view(t, -1, a.head_dim) for n in "qkv")
        inv = 1.0 / a.rope.theta ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim)
        ang = torch.arange(t).float()[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

        def rot(z):
            half = z.shape[-1] // 2
            return z * cos + torch.cat([-z[..., half:], z[..., :half]], -1) * sin

        q, k = rot(q), rot(k).bfloat16().float()
        v = v.bfloat16().float()
        group = a.num_heads // a.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q, k) * a.scale
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1)
        h = h + F.linear(out, w[p + "self_attn.o_proj.weight"].float())
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate, up = (F.linear(x, w[p + f"mlp.{n}_proj.weight"].float()) for n in ("gate", "up"))
        h = h + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"].float())
    return F.linear(norm(h, w["model.norm.weight"]), w["lm_head.weight"].float())


def test_layers_with_their_own_head_dim_and_kv_heads_share_one_stack():
    """Gemma-4's shape: layers differ in head_dim, query and KV heads (set_dimension_overrides).
    Each gets its own RoPE table and its own cache pools of its shape; the logits of every
    position, through prefill chunks and the cache, equal a plain fp32 forward's."""
    cfg = model_config(LLAMA)
    shapes = [(16, 4, 2), (32, 2, 1), (64, 8, 4)]  # (head_dim, heads, KV heads) of layers 0, 1, 2
    layers = tuple(dataclasses.replace(s, attention=dataclasses.replace(s.attention, head_dim=d, num_heads=hq,
                                                                        num_kv_heads=hk, scale=d**-0.5))
                   for s, (d, hq, hk) in zip(cfg.layers, shapes))
    cfg = dataclasses.replace(cfg, layers=layers).planned((KvCacheDtype.BF16,) * 3)
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=g) / math.sqrt(shape[1]) if len(shape) > 1
               else 1 + 0.1 * torch.randn(shape, generator=g)
               for name, shape in family_of("llama").expected_tensors(cfg).items()}
    model = build_model(cfg, dict(weights), TorchOps(), 8, 64, 0, torch.device("cpu"))
    pools = [(kv.k.data.shape, kv.num_kv_heads, kv.head_dim) for kv in model.kv_cache.layers]
    assert pools == [((8, 2, 16, 16), 2, 16), ((8, 1, 16, 32), 1, 32), ((8, 4, 16, 64), 4, 64)]
    assert model.kv_cache.layout.bytes_per_token() == 4 * (2 * 16 + 32 + 4 * 64)
    ids = torch.randint(0, 128, (29,), generator=g).tolist()
    from hf_oracle import teacher_forced

    got = teacher_forced(Engine(model, 64, prefill_chunk=64), ids)
    want = _reference_forward(cfg, weights, torch.tensor(ids))
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1e-4 * scale
    chunked = Engine(model, 64, prefill_chunk=5).teacher_forced(ids)  # later chunks read earlier ones back
    assert (chunked - want).abs().max().item() < 1e-4 * scale


# --- decisions made once ----------------------------------------------------------------------------
def test_auto_is_resolved_by_the_model_config():
    cfg = model_config(LLAMA)
    assert cfg.resolve_kv_dtype("auto") == KvCacheDtype.BF16
    assert model_config(LLAMA | {"kv_cache_dtype": "fp8"}).resolve_kv_dtype("auto") == KvCacheDtype.FP8
    assert cfg.resolve_kv_dtype(KvCacheDtype.TURBO3) == KvCacheDtype.TURBO3
    assert cfg.resolve_kv_dtype("fp8k4v") == KvCacheDtype.FP8K_TURBO4V


@pytest.mark.parametrize("declared", ["fp8_e5m2", 5])
def test_a_declared_kv_dtype_metrale_does_not_serve_names_config_json(declared):
    cfg = model_config(LLAMA | {"kv_cache_dtype": declared})
    with pytest.raises(MetraleError, match=f"config.json kv_cache_dtype {declared!r} is not a KV-cache dtype"):
        cfg.resolve_kv_dtype("auto")
    assert cfg.resolve_kv_dtype("turbo3") == KvCacheDtype.TURBO3  # an explicit dtype does not read it


def test_the_command_line_parses_the_kv_dtype_once(monkeypatch):
    """Every command gets a KvCacheDtype from the option's parser (aliases resolved), not a string
    to parse again; a bad value is one error line naming the valid ones."""
    seen = {}
    from metrale_cli.commands import bench, generate, validate

    monkeypatch.setattr(generate, "run_generate", lambda out, model, opts, *a, **k: seen.update(gen=opts.kv_cache_dtype))
    monkeypatch.setattr(bench, "run_bench_cmd", lambda out, opts, *a: seen.update(bench=opts.kv_cache_dtypes))
    monkeypatch.setattr(validate, "run_validate", lambda out, dtype, *a: seen.update(validate=dtype))
    runner = CliRunner()
    assert runner.invoke(app, ["generate", "--kv-cache-dtype", "fp8k4v", "hi"]).exit_code == 0
    assert runner.invoke(app, ["bench", "--kv-cache-dtype", "bf16", "--kv-cache-dtype", "turbo4k3v"]).exit_code == 0
    assert runner.invoke(app, ["validate-kernels", "--kv-cache-dtype", "ALL"]).exit_code == 0
    assert seen == {"gen": KvCacheDtype.FP8K_TURBO4V, "bench": (KvCacheDtype.BF16, KvCacheDtype.TURBO4K_TURBO3V),
                    "validate": "all"}
    assert runner.invoke(app, ["generate", "hi"]).exit_code == 0 and seen["gen"] == "auto"
    bad = runner.invoke(app, ["generate", "--kv-cache-dtype", "int4", "hi"])  # main() prints it as one line
    assert isinstance(bad.exception, MetraleError) and bad.exception.message == "Unsupported --kv-cache-dtype 'int4'"
    assert bad.exception.hint.startswith("valid values: bf16, fp8")


def test_each_layer_holds_its_attention_kernels_from_build_time():
    """The attention a layer launches through is resolved once, for its spec's dtype and head_dim,
    and shared by the layers of the same (dtype, head_dim)."""
    from metrale_cli.kernels.cuda_ops import CudaOps
    from test_kernels_cuda_ops import RecordingLoader

    ops = CudaOps(RecordingLoader())
    cfg = model_config(LLAMA | {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4})
    cfg = cfg.planned((KvCacheDtype.BF16, KvCacheDtype.TURBO4, KvCacheDtype.TURBO4, KvCacheDtype.BF16))
    from metrale_cli.commands.bench_presets import random_weights

    raw = LLAMA | {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4}
    model = build_model(cfg, random_weights(raw, torch.device("cpu"), torch.bfloat16), ops, 4, 32, 0,
                        torch.device("cpu"))
    kernels = [(layer.attention.dtype, layer.attention.head_dim) for layer in model.layers]
    assert kernels == [(KvCacheDtype.BF16, 64), (KvCacheDtype.TURBO4, 64), (KvCacheDtype.TURBO4, 64),
                       (KvCacheDtype.BF16, 64)]
    assert model.layers[1].attention is model.layers[2].attention is not model.layers[0].attention
    assert str(model.layers[1].attention.kernels.decode[0]) == "paged_decode_turbo4_128::paged_decode_attn_turbo4"


def test_fused_rows_is_torch_cat_and_a_view_where_the_parts_lie_in_a_row():
    """decoder.fused_rows: the values of torch.cat; no copy where the parts follow one another in
    one storage, a copy where anything is between, out of order, strided or of another storage."""
    from metrale_cli.models.decoder import fused_rows

    flat = torch.randn(7 * 4 + 4, dtype=torch.bfloat16).view(8, 4)
    a, b, c = flat[0:2], flat[2:5], flat[5:7]
    got = fused_rows([a, b, c])
    assert torch.equal(got, torch.cat([a, b, c])) and got.data_ptr() == a.data_ptr() and got.shape == (7, 4)
    assert got.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    for parts in ([a, c], [b, a], [a, flat[2:5].clone()], [a, flat[2:6:2]], [a.clone(), b], [a, b.float()]):
        got = fused_rows(parts)
        assert torch.equal(got, torch.cat(parts))
        assert all(got.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p in parts)
    assert torch.equal(fused_rows([flat[0, :3], flat[0, 3:], flat[1]]), flat[:2].flatten())  # 1-D: biases


def test_packed_views_lay_each_run_of_one_trailing_shape_out_with_no_gap():
    """A run of tensors of one dtype and trailing shape starts at a multiple of ALIGN bytes and its
    tensors follow one another (fused_rows takes them as one view); a part whose end is not at a
    multiple of 16 bytes ends its run; every tensor is 16-byte aligned and has its own bytes."""
    from metrale_cli.models.decoder import ALIGN, fused_rows, packed_views

    bf16, f32 = torch.bfloat16, torch.float32
    layout = {"norm": ((24,), bf16), "q": ((8, 24), bf16), "k": ((4, 24), bf16), "o": ((24, 8), bf16),
              "qb": ((8,), bf16), "kb": ((8,), bf16), "odd": ((3,), bf16), "vb": ((4,), bf16), "a": ((5, 24), f32)}
    views = packed_views(layout, torch.device("cpu"))
    start = {n: t.data_ptr() for n, t in views.items()}
    assert all(v.shape == layout[n][0] and v.dtype == layout[n][1] and v.data_ptr() % 16 == 0 for n, v in views.items())
    assert all(start[n] % ALIGN == 0 for n in ("norm", "q", "o", "qb", "vb", "a"))
    assert start["k"] == start["q"] + 8 * 24 * 2
    assert start["kb"] == start["qb"] + 16 and start["odd"] == start["kb"] + 16
    assert fused_rows([views["q"], views["k"]]).data_ptr() == start["q"]
    ends = sorted((start[n], start[n] + v.numel() * v.element_size()) for n, v in views.items())
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no two overlap


@pytest.mark.parametrize("preset", ["smollm2", "qwen1.5-moe-a2.7b"])
def test_a_preset_build_takes_its_fused_weights_as_views_of_the_drawn_ones(preset):
    """A bench keeps a preset's random tensors for every dtype's build (and HF's): they are drawn as
    views of one allocation, each 16-byte aligned, in the order the build fuses them, so a build's
    q/k/v and gate/up (a shared expert's too) are views of them and the weights are held once."""
    from metrale_cli.commands.bench_presets import PRESETS, random_weights

    raw = PRESETS[preset] | {"num_hidden_layers": 2, "vocab_size": 512}
    if "num_experts" in raw:
        raw |= {"num_experts": 4, "num_experts_per_tok": 2}
    tensors = random_weights(raw, torch.device("cpu"), torch.bfloat16)
    storage = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storage) == 1 and all(t.data_ptr() % 16 == 0 for t in tensors.values())
    cfg = model_config(raw)
    model = build_model(cfg, dict(tensors), TorchOps, 4, 32, 0, torch.device("cpu"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = layer.weights.qkv
        assert qkv.data_ptr() == tensors[p + "self_attn.q_proj.weight"].data_ptr()
        assert torch.equal(qkv, torch.cat([tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
        prefix = p + ("mlp.shared_expert." if "num_experts" in raw else "mlp.")
        gate_up = layer.ffn.shared.gate_up if "num_experts" in raw else layer.ffn.gate_up
        assert gate_up.data_ptr() == tensors[prefix + "gate_proj.weight"].data_ptr()
        assert torch.equal(gate_up, torch.cat([tensors[prefix + "gate_proj.weight"], tensors[prefix + "up_proj.weight"]]))



HELD_ONCE_CASES = [("qwen2", {}), ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}), ("qwen3_moe", {}),
                   ("qwen3_next", {})]


def check_held_once(folder, kept: dict, device: torch.device, tp: TensorParallel = SINGLE) -> None:
    """``kept``: an HF folder's tensors (rank ``tp``'s shard of them) as hold_once left them: its
    values (the experts stacked), each layer's in one allocation, and every build over them holding
    views of them, no copy (Qwen3-Next's attention and in-projection regroup their rows, so only
    its FFN is checked)."""
    from helpers_checkpoints import hf_state_dict

    cfg = model_config(json.loads((folder / "config.json").read_text()))
    shard, cut = shard_config(cfg, tp), Sharder(cfg, tp)
    want = {n: cut(n, t) if tp.size > 1 else t for n, t in hf_state_dict(folder).items()}
    if family_of(cfg.family).canonical is not None:
        family_of(cfg.family).canonical(shard, want)  # the experts stacked, as the builds take them
    assert set(kept) == set(want) and all(torch.equal(kept[n].cpu(), want[n]) for n in want)
    builds = [build_model(shard, dict(kept), TorchOps, 4, 32, 0, device, tp=tp) for _ in range(2)]
    for i in range(cfg.num_layers):
        own = [t for n, t in kept.items() if n.startswith(f"model.layers.{i}.")]
        storage = {t.untyped_storage().data_ptr() for t in own}
        assert len(storage) == 1 and all(t.data_ptr() % 16 == 0 for t in own)
        for model in builds:
            layer = model.layers[i]
            held = layer.ffn.tensors() if cfg.family == "qwen3_next" else layer.tensors()
            assert held and {t.untyped_storage().data_ptr() for t in held} == storage


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("family, overrides", HELD_ONCE_CASES)
def test_a_checkpoint_kept_for_several_builds_is_held_once(tmp_path, family, overrides, size):
    """`bench -m` keeps a checkpoint's tensors for every dtype's build (and HF's): hold_once stacks
    a MoE's experts once and lays each layer's tensors out in one allocation in the family's
    order, so every build takes its fused q/k/v, gate/up and experts as views of them; as a
    tensor-parallel rank (the last of ``size``), of its shard as read."""
    from helpers_checkpoints import make_hf_checkpoint

    folder = make_hf_checkpoint(tmp_path, family, **overrides)
    source, tp = ModelSource.checkpoint(str(folder)), TensorParallel(size - 1, size)
    cfg = model_config(source.config)
    kept = source.load(torch.device("cpu"), torch.bfloat16, None,
                       transform=Sharder(cfg, tp) if size > 1 else None).tensors
    hold_once(shard_config(cfg, tp), kept)
    check_held_once(folder, kept, torch.device("cpu"), tp)


@pytest.mark.gpu
@pytest.mark.parametrize("family, overrides", HELD_ONCE_CASES)
def test_bench_holds_a_checkpoint_once_on_the_gpu(tmp_path, family, overrides):
    """`bench -m` on a GPU: bench_source's tensors are held once (check_held_once)."""
    from metrale_cli.commands.bench import BenchOptions, bench_source
    from helpers_checkpoints import make_hf_checkpoint

    folder = make_hf_checkpoint(tmp_path, family, **overrides)
    source, _ = bench_source(BenchOptions(model=str(folder)), torch.device("cuda"))
    check_held_once(folder, source.load(torch.device("cuda"), torch.bfloat16, None).tensors, torch.device("cuda"))

# --- per-sequence layer states ------------------------------------------------------------------------
class _Counted:
    """A layer's state hooks counted: every state allocated once per admitted sequence, released once."""

    def __init__(self, model):
        self.allocated, self.released = [], []
        for i, layer in enumerate(model.layers):
            layer.alloc_state = lambda slot=None, i=i: self.allocated.append(i) or {"layer": i}
            layer.release_state = lambda state, i=i: self.released.append((i, state["layer"]))


def test_the_engine_allocates_and_releases_each_sequences_layer_states():
    from hf_oracle import make_hf, ours

    hf, raw = make_hf("qwen3", head_dim=32)
    engine = ours(hf, raw, blocks=3)  # room for one sequence at a time: three admissions in turn
    counted = _Counted(engine.model)
    prompts = [list(range(5, 25)), list(range(7, 19)), list(range(30, 44))]
    engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    layers = engine.model.cfg.num_layers
    assert sorted(counted.allocated) == sorted(list(range(layers)) * 3)
    assert sorted(counted.released) == sorted([(i, i) for i in range(layers)] * 3)
    assert engine.model.kv_cache.allocator.free_blocks == 3


class _Letters:
    """A tokenizer stand-in whose text is one letter per token."""

    class _Decoder:
        def push(self, token):
            return "x"

        def flush(self):
            return ""

    def stream_decoder(self):
        return self._Decoder()


def test_a_stream_yields_the_generated_text_and_gives_everything_back_when_dropped():
    from hf_oracle import make_hf, ours

    hf, raw = make_hf("llama")
    engine = ours(hf, raw, blocks=8)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    whole = list(engine.stream([list(range(3, 40))], params, (), _Letters()))
    assert whole == [(0, "x")] * 30
    counted = _Counted(engine.model)
    stream = engine.stream([list(range(3, 40))], params, (), _Letters())
    assert engine.model.kv_cache.allocator.free_blocks == 8  # nothing runs before the first read
    assert [next(stream) for _ in range(3)] == [(0, "x")] * 3
    assert engine.model.kv_cache.allocator.free_blocks < 8 and counted.released == []
    stream.close()  # the caller stops reading mid-sequence
    assert engine.model.kv_cache.allocator.free_blocks == 8 and len(counted.released) == len(counted.allocated) == 3


# --- the import graph -----------------------------------------------------------------------------------
# Each part of the package imports only from parts below it (a lower number), never from above.
LAYERS = {"errors": 0, "environment": 1, "output": 1, "kv": 2, "kernels": 3, "layers": 4, "config": 5,
          "models": 6, "checkpoint": 7, "engine": 8, "commands": 9, "api": 10, "cli": 10, "__main__": 11,
          "__init__": 12}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """{module: the package modules it imports (at any depth of the code; a package's own
    ``__init__`` counts only where a name is taken from it, not a submodule)}."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("metrale_cli"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in paths else node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("metrale_cli")}
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"  # metrale_cli itself: the lazy API face


def test_the_import_graph_only_points_down():
    graph = _imports()
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if LAYERS[_part(t)] > LAYERS[_part(m)])
    assert up == []
    assert not any(_part(t) == "kernels" for m, ts in graph.items() if _part(m) == "kv" for t in ts)
    assert not any(_part(t) == "layers" for m, ts in graph.items() if _part(m) == "kernels" for t in ts)


def test_no_modules_import_each_other():
    graph = _imports()
    seen, cycles = {}, []

    def visit(node, path):
        seen[node] = "open"
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt, path + [nxt])
        seen[node] = "done"

    for node in sorted(graph):
        if node not in seen:
            visit(node, [node])
    assert cycles == []


def test_one_cache_folder_one_head_dim_table():
    from metrale_cli.environment import cache_dir
    from metrale_cli.kernels.compile import kernel_cache_dir
    from metrale_cli.kv.dtypes import HEAD_DIMS
    from metrale_cli.kv.wht import HEAD_DIMS as WHT_HEAD_DIMS

    assert kernel_cache_dir() == cache_dir() / "kernels" and WHT_HEAD_DIMS is HEAD_DIMS
    defined = [p for p in PACKAGE.rglob("*.py") if "def cache_dir(" in p.read_text()]
    assert [p.name for p in defined] == ["environment.py"]
    assert math.prod(HEAD_DIMS) == 64 * 128 * 256 * 512


@pytest.mark.parametrize("family", sorted(CHECKPOINT_FAMILIES))
def test_a_config_without_rms_norm_eps_takes_the_hf_default_in_every_norm(family):
    """Phi-3's default is 1e-5 where the others' is 1e-6: the final norm takes the family's
    default as the layers' norms do (it had taken 1e-6 whatever the family)."""
    class_name, defaults = CHECKPOINT_FAMILIES[family]
    hf_class = getattr(T, class_name)
    raw = hf_class(**{**TINY, **defaults, "vocab_size": 320}).to_dict()
    del raw["rms_norm_eps"]
    cfg = model_config(raw)
    assert {spec.eps for spec in cfg.layers} == {cfg.rms_norm_eps} == {hf_class().rms_norm_eps}
