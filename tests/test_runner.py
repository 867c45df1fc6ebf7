"""Runner levers: METRALE_PREFILL_HOST_TIMING (per-phase host time of prefill, off by default),
METRALE_DECODE_STACK and the decode mode line (CUDA graphs, or eager and why)."""

from __future__ import annotations

import math

import pytest
import torch

from metrale_cli.bench_presets import PRESETS, random_weights
from metrale_cli.config import model_config_from_hf
from metrale_cli.engine.runner import RunnerOptions, build_runner
from metrale_cli.engine.sequence import Sequence
from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.layers.host_timing import PHASES
from metrale_cli.models.dense import expected_tensors

TINY = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 300,
        "max_position_embeddings": 256}


def _runner():
    weights = random_weights(TINY, torch.device("cpu"), torch.bfloat16)
    opts = RunnerOptions(backend="torch", max_seq_len=64, prefill_chunk=8)
    return build_runner(TINY, weights, None, opts, "torch", KvCacheDtype.BF16, "tiny")


def test_host_timing_accumulates_every_phase(monkeypatch):
    monkeypatch.setenv("METRALE_PREFILL_HOST_TIMING", "1")
    runner = _runner()
    timing = runner.engine.host_timing
    for n in (20, 5):
        runner.engine.prefill(Sequence(0, list(range(n)), 1))
    assert timing.prefills == 2
    assert set(timing.us) == set(PHASES) and all(v > 0 for v in timing.us.values())
    assert timing.per_prefill()["ffn"] == pytest.approx(timing.us["ffn"] / 2)
    seq = Sequence(0, [1, 2, 3], 4)
    runner.engine.prefill(seq)
    after_prefill = dict(timing.us)
    seq.output_ids.append(5)
    runner.engine.decode([seq])
    assert timing.us == after_prefill and timing.prefills == 3  # decode is not timed


def test_host_timing_is_off_by_default_and_checked(monkeypatch):
    monkeypatch.delenv("METRALE_PREFILL_HOST_TIMING", raising=False)
    assert _runner().engine.host_timing is None
    monkeypatch.setenv("METRALE_PREFILL_HOST_TIMING", "yes")
    with pytest.raises(MetraleError, match="is not an integer"):
        _runner()


def test_decode_mode_says_why_it_is_eager():
    runner = _runner()
    assert not runner.engine.graphs.capture and "decode: eager (no GPU)" in runner.messages
    assert runner.model.decode_graph_unsupported() == (
        "layer 0: the torch backend's attention reads context lengths on the host")


def test_decode_stack_lever(monkeypatch):
    """METRALE_DECODE_STACK=1 asks for the whole-stack step; a backend without one (torch) says so
    and the layers run one by one. Unset, nothing is planned and nothing is said."""
    monkeypatch.delenv("METRALE_DECODE_STACK", raising=False)
    runner = _runner()
    assert runner.model.stack_plan is None and not any("DECODE_STACK" in m for m in runner.messages)
    monkeypatch.setenv("METRALE_DECODE_STACK", "1")
    runner = _runner()
    assert runner.model.stack_plan is None
    assert any(m.startswith("METRALE_DECODE_STACK: the whole-stack kernel does not serve") for m in runner.messages)
    monkeypatch.setenv("METRALE_DECODE_STACK", "on")
    with pytest.raises(MetraleError, match="is not an integer"):
        _runner()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_decode_reads_every_weight_but_an_untied_embedding_table(preset):
    """The roofline's weight bytes: every tensor of the checkpoint once, less the input embedding
    table when the LM head has its own (a decode step gathers one row of it per token)."""
    cfg = model_config_from_hf(PRESETS[preset])
    shapes = expected_tensors(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    untied = "lm_head.weight" in shapes
    assert untied == (not cfg.tie_word_embeddings)
    embed = math.prod(shapes["model.embed_tokens.weight"])
    assert cfg.num_parameters() == total
    assert cfg.decode_parameters() == total - (embed if untied else 0)
