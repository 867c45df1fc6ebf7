"""The runner's entry point: the decode mode line (CUDA graphs, or eager and why), the options it
checks before anything is read, the bytes a decode step reads (the roofline's), and the kernels
the cuda backend's start-up check loads."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

from metrale_cli.commands.bench_presets import random_weights
from metrale_cli.engine.runner import RunnerOptions, check_kernels, open_runner, plan
from metrale_cli.engine.source import ModelSource
from metrale_cli.errors import MetraleError
from metrale_cli.kernels import loader
from metrale_cli.kernels.table import GDN_KERNELS
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.models import family_of, model_config

TINY = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 300,
        "max_position_embeddings": 256}


def _runner(raw=TINY, **options):
    weights = random_weights(raw, torch.device("cpu"), torch.bfloat16)
    opts = RunnerOptions(backend="torch", max_seq_len=64, prefill_chunk=8, **options)
    return open_runner(opts, ModelSource.loaded(raw, weights, None, "tiny"))


def test_decode_mode_says_why_it_is_eager():
    runner = _runner()
    assert not runner.engine.graphs.capture and "decode: eager (no GPU)" in runner.messages
    assert runner.model.decode_graph_unsupported() == (
        "layer 0: the torch backend's attention reads context lengths on the host")


@pytest.mark.parametrize("kv, tokens, line", [
    (KvCacheDtype.BF16, 64, "fp8 KV scales: none (--fp8-kv-calibration-tokens calibrates an fp8 side; "
                            "no layer's K or V side is fp8)"),
    (KvCacheDtype.BF16, None, None),
    (KvCacheDtype.FP8, None, "fp8 KV scales: online calibration over each layer's first write, at most 256 tokens "
                             "(amax/448, then frozen)"),
    (KvCacheDtype.FP8, 0, "fp8 KV scales: 1.0 (checkpoint has none; calibration off)"),
])
def test_fp8_calibration_tokens_are_never_ignored_unsaid(kv, tokens, line):
    messages = _runner(kv_cache_dtype=kv, fp8_kv_calibration_tokens=tokens).messages
    assert [m for m in messages if m.startswith("fp8 KV scales")] == ([line] if line else [])


@pytest.mark.parametrize("option, value, message", [
    ("dtype", "fp64", "unknown --dtype 'fp64'"),
    ("cuda_graph_mode", "half", "unknown --cuda-graph-mode 'half'"),
    ("max_seq_len", 1, "--max-seq-len must be at least 2"),
    ("gpu_memory_utilization", 1.5, "--gpu-memory-utilization must be in"),
    ("prefill_chunk", 0, "--prefill-chunk must be at least 1"),
])
def test_options_out_of_range_are_refused_before_anything_is_read(option, value, message):
    never = ModelSource({"model_type": "qwen3"}, lambda: pytest.fail("read"), lambda *a: pytest.fail("loaded"))
    with pytest.raises(MetraleError, match=message):
        open_runner(RunnerOptions(backend="torch", **{option: value}), never)


def test_a_gpu_pool_is_the_memory_fraction_less_what_is_in_use(monkeypatch):
    """On a GPU the pool is --gpu-memory-utilization of the card less what is in use (the
    weights), in whole blocks; a pool that cannot hold one sequence of --max-seq-len is one error."""
    from metrale_cli.engine.runner import pool_blocks
    from metrale_cli.kv.paged import blocks_for
    from metrale_cli.models import kv_layout

    gb, layout = 10**9, kv_layout(model_config(TINY))
    opts = RunnerOptions(gpu_memory_utilization=0.5)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * gb, 100 * gb))
    assert pool_blocks(layout, opts, 64, torch.device("cuda")) == 30 * gb // layout.bytes_per_block()
    short = 50 * gb + blocks_for(64) * layout.bytes_per_block() - 1  # one byte short of a sequence
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (short, 100 * gb))
    with pytest.raises(MetraleError, match=f"KV cache pool too small: {blocks_for(64) - 1} blocks fit"):
        pool_blocks(layout, opts, 64, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * gb, 100 * gb))
    with pytest.raises(MetraleError, match="KV cache pool too small: 0 blocks fit"):
        pool_blocks(layout, opts, 64, torch.device("cuda"))


@pytest.mark.parametrize("tie", [True, False])
def test_decode_reads_every_weight_but_an_untied_embedding_table(tie):
    """The roofline's weight bytes: every tensor of the checkpoint once, less the input embedding
    table when the LM head has its own (a decode step gathers one row of it per token)."""
    raw = TINY | {"tie_word_embeddings": tie}
    cfg = model_config(raw)
    shapes = family_of("qwen3").expected_tensors(cfg)
    total = 2 * sum(math.prod(s) for s in shapes.values())
    embed = 2 * math.prod(shapes["model.embed_tokens.weight"])
    assert ("lm_head.weight" in shapes) == (not tie)
    assert _runner(raw).model.weight_bytes() == total - (0 if tie else embed)


HYBRID = TINY | {"model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 4,
                 "partial_rotary_factor": 0.25, "intermediate_size": 128, "num_experts": 0, "mlp_only_layers": [],
                 "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                 "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4}


class _RecordingLoader:
    """Stands in for the CuPy loader of the start-up check: every kernel it was asked for loads."""

    asked: ClassVar[list] = []

    def function(self, spec, device):
        self.asked.append(spec)


@pytest.mark.parametrize("arch, head_dim, refused", [("sm_90", 256, False), ("sm_89", 128, True),
                                                     ("sm_89", 64, False), ("sm_80", 128, False), ("sm_80", 256, True)])
def test_a_hybrid_is_refused_at_start_up_where_its_prefill_chunk_does_not_fit_a_block(monkeypatch, arch, head_dim,
                                                                                       refused):
    """gdn_chunk_prep_f32 stages a 64-token chunk in shared memory (102 KB at head dims 128, 166
    KB at 256): an sm_89 block may have 99 KB, an sm_80 one 163 KB."""
    monkeypatch.setattr(loader, "KernelLoader", _RecordingLoader)
    monkeypatch.setattr(loader, "device_arch", lambda index: arch)
    monkeypatch.setattr(loader, "device_index", lambda device: 0)
    raw = HYBRID | {"linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim}
    planned = plan(model_config(raw), KvCacheDtype.BF16, RunnerOptions())
    if not refused:
        assert check_kernels(planned, "cuda", torch.device("cuda", 0)) is not None
        return
    with pytest.raises(MetraleError, match=f"Gated DeltaNet prefill kernel needs .* an {arch} GPU allows") as e:
        check_kernels(planned, "cuda", torch.device("cuda", 0))
    assert "--backend torch" in e.value.hint


@pytest.mark.parametrize("raw, gdn", [(TINY, False), (HYBRID, True)])
def test_the_cuda_start_up_check_loads_the_gdn_kernels_of_a_hybrid(monkeypatch, raw, gdn):
    monkeypatch.setattr(loader, "KernelLoader", _RecordingLoader)
    monkeypatch.setattr(_RecordingLoader, "asked", [])
    check_kernels(plan(model_config(raw), KvCacheDtype.BF16, RunnerOptions()), "cuda", torch.device("cpu"))
    asked = set(_RecordingLoader.asked)
    assert asked and (set(GDN_KERNELS) <= asked) == gdn
