"""The whole-stack decode tool (tools/decode_stack/) without a GPU: its launch, its planner's
refusals, and its wiring to a built model (the layers handed over in order, the reference step
equal to the model's own batch-1 decode)."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import make_hf, ours
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.errors import MetraleError
from metrale_cli.kernels import cuda_launch
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.layers.context import ForwardContext
from test_kernels_cuda_ops import RecordingLoader
from tools.decode_stack import stack as tool


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(cuda_launch, "_sm_count", lambda index: 132)
    return RecordingLoader()


@pytest.mark.parametrize("hq, hk, max_blocks, splits", [
    (16, 8, 64, 16),  # Qwen3-0.6B: 8 items per split, 16 splits fill the 132 SMs
    (32, 8, 64, 16),  # Qwen3-8B: a group of 4 still takes one CTA per KV head
    (32, 2, 64, 32),  # a group of 16: two CTAs per KV head, 4 items per split: capped at MAX_SPLITS
    (16, 8, 2, 1),  # a 32-token table: one split of at least 32 keys
])
def test_decode_stack_launch(recording, hq, hk, max_blocks, splits):
    """One persistent launch per step: a CTA per SM, the ring's shared memory, the layer table's
    pointers in order, and the split count filling the grid with attention items."""
    c = tool.make_stack_case(2, 256, hq, hk, 64, 384, context=20)
    plan = tool.StackPlan(c["stack"])
    tables = torch.zeros(1, max_blocks, dtype=torch.int32)
    ctx = ForwardContext("decode", c["positions"], c["slot_mapping"], block_tables=tables, seq_lens=c["seq_lens"])
    hidden = c["hidden"].clone()
    assert tool.decode_stack(recording, plan, hidden, ctx) is hidden
    (name, grid, block, args, _), = recording.calls
    assert (name, grid, block) == ("decode_stack::decode_stack_bf16", (132,), (tool.STACK_BLOCK,))
    assert recording.shared_mem == {name: tool.STACK_SMEM_BYTES} and recording.programmatic == [name]
    assert args["num_splits"] == splits and args["num_layers"] == 2 and args["hq"] == hq
    layer = c["stack"].layers[1]
    assert args["layers"][1].tolist() == [t.data_ptr() for t in (
        layer.qkv, layer.o, layer.gate_up, layer.down, layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm,
        layer.kv.k.data, layer.kv.v.data)]
    assert int(args["sync"].numel()) == 2 + hk * -(-hq // hk // 8) and not args["sync"].any()
    with pytest.raises(ValueError, match="one sequence"):
        tool.decode_stack(recording, plan, torch.zeros(2, 256, dtype=torch.bfloat16), ctx)


def test_decode_stack_is_not_planned_off_a_gpu():
    stack = tool.make_stack_case(1, 256, 4, 2, 64, 384, context=3)["stack"]
    assert tool.stack_unserved(stack) == "not on a GPU" and tool.plan(stack) is None


def test_the_tool_module_compiles_with_the_package_headers():
    from metrale_cli.kernels import compile as kc

    cubin, log = kc.compile_cubin(tool.MODULE)
    assert cubin is not None, log
    assert kc.function_symbols(cubin) == ("decode_stack_bf16",)
    with pytest.raises(MetraleError, match="not in this build"):  # the package's loader does not know it
        from metrale_cli.kernels.loader import KernelLoader

        KernelLoader()._module(tool.KERNEL[0], 0)


class _Fused(TorchOps):
    """The torch references with the fused batch-1 GEMVs on: the wiring the cuda backend runs."""

    @staticmethod
    def gemv_fits(k: int, dtype: torch.dtype) -> bool:
        return k % 8 == 0 and dtype == torch.bfloat16


def test_a_models_stack_steps_as_its_layers_do():
    """stack_of hands over every layer's weights, norms and cache in order; one reference step
    of that stack equals the model's own batch-1 decode step (same logits, same cache row)."""
    hf, raw = make_hf("qwen3")
    engine = ours(hf, raw, ops=_Fused())
    model = engine.model
    stack = tool.stack_of(model)
    assert len(stack.layers) == raw["num_hidden_layers"] and stack.num_heads == raw["num_attention_heads"]
    for part, layer in zip(stack.layers, model.layers):
        assert part.qkv is layer.weights.qkv and part.down is layer.ffn.down and part.kv is layer.kv
        assert part.post_norm is layer.ffn_norm and part.k_norm is layer.weights.k_norm
    seq = engine.generate([list(range(1, 30))], SamplingParams(max_new_tokens=1, ignore_eos=True))[0][0]
    prompt = seq.prompt_ids
    engine.prefill(seq)  # the prompt back in the cache, its blocks and states held again
    n = len(prompt) + 1
    table = torch.tensor([seq.block_table], dtype=torch.int32)
    slot = torch.tensor([seq.block_table[(n - 1) // 16] * 16 + (n - 1) % 16], dtype=torch.int32)
    ctx = ForwardContext("decode", torch.tensor([n - 1], dtype=torch.int32), slot, block_tables=table,
                         seq_lens=torch.tensor([n], dtype=torch.int32), states=[seq.states])
    token = torch.tensor([seq.output_ids[0]])
    snapshot = [kv.k.data.clone() for kv in model.kv_cache.layers]
    want = model.forward(token, ctx, None)
    rows = [kv.k.data.clone() for kv in model.kv_cache.layers]
    for kv, before in zip(model.kv_cache.layers, snapshot):
        kv.k.data.copy_(before)
    h = tool.decode_stack_reference(model.ops, stack, torch.nn.functional.embedding(token, model.embed), ctx)
    got = model.ops.gemv_norm_logits(h, None, model.final_norm, model.cfg.rms_norm_eps, model.lm_head)
    assert torch.equal(got, want)
    assert all(torch.equal(kv.k.data, row) for kv, row in zip(model.kv_cache.layers, rows))
