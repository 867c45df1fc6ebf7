"""The GPU profiling tools' kernels, and the build variants they time, compile for sm_90.

They run only on a GPU (tools/handoff_latency.py, tools/decode_stack/profile.py); here each
variant must compile and export its kernels, so a tool's figures stay reproducible.
"""

import dataclasses

import pytest

from metrale_cli.kernels import compile as kc
from metrale_cli.kernels.registry import KernelModule
from tools.decode_stack.stack import MODULE as STACK


@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("proto", [0, 1, 2])
def test_handoff_latency_kernels_compile(proto, stream):
    module = KernelModule("handoff_latency", "../tools/handoff_latency.cu",
                          (("HOP_PROTO", str(proto)), ("HOP_STREAM", str(stream))), ("hop", "hop_cluster"))
    cubin, log = kc.compile_cubin(module)
    assert cubin is not None, log
    assert kc.function_symbols(cubin) == ("hop", "hop_cluster")


@pytest.mark.parametrize("defines", [(("STACK_PIECE_BYTES", "0"),),
                                     (("STACK_PIECE_BYTES", "8192"), ("STACK_PACE_NS", "0")),
                                     (("STACK_TIMING_NO_WEIGHT_WAIT", "1"),),
                                     (("STACK_TIMING_NO_DOT", "1"),)])
def test_the_whole_stack_kernel_variants_compile(defines):
    module = dataclasses.replace(STACK, defines=STACK.defines + defines)
    cubin, log = kc.compile_cubin(module)
    assert cubin is not None, log
    assert kc.function_symbols(cubin) == tuple(sorted(STACK.functions))


def test_the_decode_at_every_ctas_an_sm_variant_compiles():
    """tools/batch_decode.py's TC_CTAS_ALL variant: every tensor-core decode entry builds at 4 CTAs
    an SM and the module exports the same functions."""
    from metrale_cli.kernels import registry
    from tools.batch_decode import parse_variant

    base = registry.MODULES["paged_decode_tc"]
    module = dataclasses.replace(base, defines=base.defines + parse_variant("TC_CTAS_ALL=4"))
    cubin, log = kc.compile_cubin(module)
    assert cubin is not None, log
    assert kc.function_symbols(cubin) == tuple(sorted(base.functions))


@pytest.mark.parametrize("text", ["TC_CTAS_ALL", "=4", "TC_CTAS_ALL=", "A=1,B"])
def test_batch_decode_refuses_a_malformed_variant(text):
    import argparse

    from tools.batch_decode import parse_variant

    with pytest.raises(argparse.ArgumentTypeError):
        parse_variant(text)


def test_prefill_host_timing_times_every_phase_from_outside_the_layers():
    """tools/prefill_host_timing.py on the CPU: every phase takes time and the phases add up to the
    layers' total."""
    import torch

    from metrale_cli.commands.bench_presets import random_weights
    from metrale_cli.engine.runner import RunnerOptions, open_runner
    from metrale_cli.engine.sequence import Sequence
    from metrale_cli.engine.source import ModelSource
    from tools import prefill_host_timing as tool

    raw = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 300,
           "max_position_embeddings": 256}
    runner = open_runner(RunnerOptions(backend="torch", max_seq_len=64, fp8_kv_calibration_tokens=0),
                         ModelSource.loaded(raw, random_weights(raw, torch.device("cpu"), torch.bfloat16)))
    totals = tool.instrument(runner.model)
    for n in (20, 5):
        seq = Sequence(0, list(range(n)), 1)
        runner.engine.prefill(seq)
        runner.engine.release(seq)
    phases = tool.per_prefill(totals, 2)
    assert list(phases) == ["qk-norm, RoPE and cache write", "attention call", "ffn", "norms and projections"]
    assert all(us > 0 for us in phases.values())
    assert sum(phases.values()) == pytest.approx(totals["layer"] / 2)
    assert runner.model.layers[0].attention.dtype.value == "bf16"  # the wrapped attention is still the layer's


@pytest.mark.parametrize("ffn", [["--dense", "96"], ["--experts", "8", "--inter", "32", "--top-k", "2"],
                                 ["--experts", "8", "--inter", "32", "--top-k", "2", "--shared", "48"],
                                 ["--dense", "96", "--kv-cache-dtype", "turbo4k_turbo3v"],
                                 ["--experts", "8", "--inter", "32", "--top-k", "2", "--shared", "32", "--gdn",
                                  "--gdn-k-heads", "2", "--gdn-v-heads", "4", "--gdn-head-dim", "16"]])
def test_the_layer_launches_run_on_the_reference_ops(ffn):
    """moe_layer_launches' launches, built on the torch reference on the CPU at a small shape: each
    runs, and the whole layer gives a row of the hidden size; the attention over the cache dtype
    asked for."""
    import torch

    from metrale_cli.kernels.reference import TorchOps
    from tools import moe_layer_launches

    a = moe_layer_launches.parser().parse_args(["--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                                "--layers", "2", "--context", "40", *ffn])
    launches = moe_layer_launches.build(a, TorchOps(), "cpu")
    assert ("dense FFN (DenseSwiGluFfn.add_row)" in launches) == ("--dense" in ffn)
    assert ("gdn decode" in launches) == ("attention" not in launches) == ("--gdn" in ffn)
    assert a.kv_cache_dtype == (ffn[-1] if "--kv-cache-dtype" in ffn else "bf16")
    for fn in launches.values():
        fn(1)
    out = launches["whole layer"](0)
    assert out.shape == (1, 64) and torch.isfinite(out.float()).all()


def test_the_layer_launches_force_the_attention_splits(monkeypatch):
    """--attention-splits replaces the split rule of every tensor-core decode built after it (for
    an A/B of the rule), and a count the launch cannot combine is one error."""
    from metrale_cli.kernels import cuda_attention
    from tools import moe_layer_launches

    monkeypatch.setattr(cuda_attention, "tc_decode_splits", cuda_attention.tc_decode_splits)
    assert moe_layer_launches.parser().parse_args([]).attention_splits == 0
    moe_layer_launches.force_attention_splits(6)
    assert cuda_attention.tc_decode_splits("cuda", 4, 40, None) == 6
    for bad in (0, 65):
        with pytest.raises(SystemExit, match="--attention-splits must be 1 to 64"):
            moe_layer_launches.force_attention_splits(bad)


def test_a_layer_variant_names_a_registry_module_and_its_defines():
    import argparse

    from tools.layer_variants import parse_variant

    assert parse_variant("gemv:GEMV_X=0") == ("gemv", (("GEMV_X", "0"),))
    assert parse_variant("paged_decode_tc:A=1,B=x") == ("paged_decode_tc", (("A", "1"), ("B", "x")))
    for bad in ("nomodule:A=1", "gemv", "gemv:A", "gemv:=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)


def test_a_py_variant_sets_a_host_constant_and_the_base_build_restores_it(monkeypatch):
    import argparse

    from metrale_cli.kernels import cuda_moe, registry
    from tools.layer_variants import parse_variant, use_build

    assert parse_variant("py:cuda_moe.MOE_GATE_UP_ONE_PER_SM=0") == ("py", (("cuda_moe.MOE_GATE_UP_ONE_PER_SM", "0"),))
    for bad in ("py:cuda_moe.NO_SUCH=1", "py:nomodule.X=1", "py:cuda_moe.MOE_GATE_UP_ONE_PER_SM=x",
                "py:cuda_moe.MOE_GATE_UP_ONE_PER_SM="):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)

    class Ops:  # what use_build touches of CudaOps
        loader = type("L", (), {"_functions": {"f": 1}})()

    monkeypatch.setattr(cuda_moe, "MOE_GATE_UP_ONE_PER_SM", 3)
    base = dict(registry.MODULES)
    host_base = {"cuda_moe.MOE_GATE_UP_ONE_PER_SM": 3}
    use_build(Ops, base, dict([parse_variant("py:cuda_moe.MOE_GATE_UP_ONE_PER_SM=2")]), host_base)
    assert cuda_moe.MOE_GATE_UP_ONE_PER_SM == 2 and registry.MODULES == base and not Ops.loader._functions
    use_build(Ops, base, {}, host_base)
    assert cuda_moe.MOE_GATE_UP_ONE_PER_SM == 3


@pytest.mark.parametrize("text, ok", [("0", True), ("50", True), ("100", True), ("-1", False), ("101", False)])
def test_the_layer_tools_take_a_carveout_in_percent(text, ok):
    import argparse

    from tools import moe_layer_launches

    if ok:
        assert moe_layer_launches.parser().parse_args(["--carveout", text]).carveout == int(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            moe_layer_launches.carveout(text)


def test_the_expert_read_patterns_compile():
    """tools/expert_read_patterns.py's pure-load kernels (its figures in docs/performance.md)."""
    from tools.expert_read_patterns import KERNELS

    module = KernelModule("expert_read_patterns", "../tools/expert_read_patterns.cu", (), KERNELS)
    cubin, log = kc.compile_cubin(module)
    assert cubin is not None, log
    assert kc.function_symbols(cubin) == tuple(sorted(KERNELS))
