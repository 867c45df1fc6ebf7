"""The whole-stack decode tool (tools/decode_stack/) against the layers' own batch-1 path (GPU only).

The reference is :func:`decode_stack_reference` through ``CudaOps``: the fused GEMVs,
rope_and_cache and the tensor-core decode, launched one by one. The stack's GEMVs and its
QK-norm / RoPE / cache write round exactly as those kernels; its attention splits the context its
own way, so its fp32 sums (and so the output of attention, in the last bf16 bit) may differ.
Hence: layer 0's cache row is equal byte for byte (it depends on the GEMV only), the running sum
after all layers within bf16 noise (two ulps of its largest element: a rounding flipped early
carries through the residual adds). Both are also held against the torch references on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from metrale_cli.kernels.cases import compare
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.layers.context import ForwardContext
from tools.decode_stack import stack as tool
from tools.decode_stack.stack import StackPlan, decode_stack_reference, make_stack_case, stack_to

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels():
    return tool.loader()


def _ctx(c, device) -> ForwardContext:
    t = [c[n].to(device) for n in ("positions", "slot_mapping", "block_tables", "seq_lens")]
    return ForwardContext("decode", t[0], t[1], block_tables=t[2], seq_lens=t[3])


def _rows(stack, slot: int, layer: int):
    part = stack.layers[layer]
    return [p.data[slot // 16, :, slot % 16].cpu() for p in (part.kv.k, part.kv.v)]


# (layers, hidden, hq, hk, head_dim, inter, context): small odd shapes, a group of 16 (two CTAs
# of 8 heads per KV head), the first decode token (context 0), block edges, long contexts,
# Qwen3-0.6B's layer shape, and Qwen3-8B's (one down row per ring stage: the planner leaves it to
# the per-layer launches, the kernel still computes it)
CASES = [
    (2, 256, 4, 2, 64, 384, 45),
    (3, 512, 8, 8, 128, 1024, 0),
    (2, 256, 32, 2, 64, 256, 15),
    (2, 384, 8, 4, 128, 768, 16),
    (2, 256, 16, 2, 128, 512, 17),
    (2, 1024, 16, 8, 128, 3072, 600),
    (1, 1024, 16, 8, 128, 3072, 4099),
    (4, 4096, 32, 8, 128, 12288, 700),
]


@pytest.mark.parametrize("case", CASES, ids=[f"L{c[0]}-h{c[1]}-q{c[2]}k{c[3]}-d{c[4]}-i{c[5]}-ctx{c[6]}" for c in CASES])
def test_stack_equals_the_layer_path(ops, kernels, case):
    layers, hidden, hq, hk, d, inter, context = case
    c = make_stack_case(layers, hidden, hq, hk, d, inter, context, seed=sum(case))
    mine, theirs = stack_to(c["stack"], "cuda"), stack_to(c["stack"], "cuda")
    plan = tool.plan(mine)
    if tool.STACK_STAGE_BYTES // (2 * max(hidden, hq * d, inter)) < tool.STACK_MIN_ROWS:
        assert plan is None
        plan = StackPlan(mine)
    assert plan is not None
    got = tool.decode_stack(kernels, plan, c["hidden"].cuda(), _ctx(c, "cuda"))
    want = decode_stack_reference(ops, theirs, c["hidden"].cuda(), _ctx(c, "cuda"))
    slot = int(c["slot_mapping"][0])
    for a, b in zip(_rows(mine, slot, 0), _rows(theirs, slot, 0)):
        assert torch.equal(a, b)
    # The two paths split attention differently; a last-bit difference there can flip a rounding
    # of the bf16 running sum, so allow two bf16 ulps of the sum's largest element on top.
    err = compare(got, want, max(2e-2, want.float().abs().max().item() / 64), 2e-2)
    assert err is None, err
    for layer in range(layers):  # the new row only: every other slot is untouched
        assert compare(*(torch.cat(_rows(s, slot, layer)) for s in (mine, theirs)), 2e-2, 2e-2) is None
        for side in ("k", "v"):
            a, b = getattr(mine.layers[layer].kv, side).data, getattr(c["stack"].layers[layer].kv, side).data
            a = a.cpu().clone()
            a[slot // 16, :, slot % 16] = b[slot // 16, :, slot % 16]
            assert torch.equal(a, b)
    if context < 1000 and hidden <= 1024:  # and the torch references on the CPU (small stacks: the
        # 8B-wide one sums 4096-12288-long rows in another order, several bf16 ulps apart)
        cpu = decode_stack_reference(TorchOps, stack_to(c["stack"], "cpu"), c["hidden"], _ctx(c, "cpu"))
        err = compare(got, cpu, 3e-2, 3e-2)
        assert err is None, err


def test_steps_in_a_graph_replay_with_moving_inputs(ops, kernels):
    """Ten steps of one sequence through a captured graph (static inputs rewritten between
    replays): each step equals the layer path's, so the launch generation and combine counters
    move on correctly."""
    c = make_stack_case(2, 512, 8, 2, 128, 1024, 70, seed=5)  # the table covers positions up to 70
    mine, theirs = stack_to(c["stack"], "cuda"), stack_to(c["stack"], "cuda")
    plan = tool.plan(mine)
    ctx = _ctx(c, "cuda")
    hidden = torch.empty(1, 512, dtype=torch.bfloat16, device="cuda")
    x = c["hidden"].cuda()
    hidden.copy_(x)
    ctx.positions.fill_(59)  # a step at position 59 to warm up (loads the module outside the capture)
    ctx.seq_lens.fill_(60)
    table = ctx.block_tables[0]
    ctx.slot_mapping.fill_(int(table[59 // 16]) * 16 + 59 % 16)
    tool.decode_stack(kernels, plan, hidden, ctx)
    decode_stack_reference(ops, theirs, x.clone(), ctx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tool.decode_stack(kernels, plan, hidden, ctx)
    for step in range(10):
        pos = 60 + step
        ctx.positions.fill_(pos)
        ctx.seq_lens.fill_(pos + 1)
        ctx.slot_mapping.fill_(int(table[pos // 16]) * 16 + pos % 16)
        x = (x.float() * 0.9 + 0.1 * step).to(torch.bfloat16)
        hidden.copy_(x)
        graph.replay()
        want = decode_stack_reference(ops, theirs, x.clone(), ctx)
        err = compare(out, want, 2e-2, 2e-2)
        assert err is None, f"step {step}: {err}"
    sync = plan.sync.cpu()  # a generation per launch (11); the combine counters back at zero
    assert sync[0] == 11 and not sync[2:].any()


def test_unserved_stacks_are_not_planned():
    c = make_stack_case(1, 256, 4, 2, 64, 384, 10)
    stack = stack_to(c["stack"], "cuda")
    stack.layers[0].o = stack.layers[0].o.float()
    assert tool.plan(stack) is None
    stack = stack_to(c["stack"], "cuda")
    stack.head_dim, stack.num_heads = 256, 1  # not a tensor-core head_dim
    assert tool.plan(stack) is None


def test_a_models_decode_step_through_the_stack_equals_its_layers(ops, kernels):
    """A random Qwen3-0.6B-shape model: one decode step through the tool's kernel (the stack from
    stack_of) against the same step through the model's own launches, from the same cache."""
    from metrale_cli.commands.bench_presets import PRESETS, random_weights
    from metrale_cli.engine.runner import RunnerOptions, open_runner
    from metrale_cli.engine.sequence import Sequence
    from metrale_cli.engine.source import ModelSource

    torch.manual_seed(0)
    raw = PRESETS["qwen3-0.6b"]
    weights = random_weights(raw, torch.device("cuda"), torch.bfloat16)
    runner = open_runner(RunnerOptions(backend="cuda", max_seq_len=256, reserve_all_memory=False),
                         ModelSource.loaded(raw, weights))
    model, engine = runner.model, runner.engine
    seq = Sequence(0, torch.randint(0, 151936, (100,), generator=torch.Generator().manual_seed(1)).tolist(), 2)
    seq.output_ids.append(int(engine.prefill(seq).argmax()))
    engine.model.kv_cache.ensure_capacity(seq.block_table, 101)
    n, table = 101, seq.block_table
    ctx = ForwardContext("decode", torch.tensor([n - 1], dtype=torch.int32, device="cuda"),
                         torch.tensor([table[(n - 1) // 16] * 16 + (n - 1) % 16], dtype=torch.int32, device="cuda"),
                         block_tables=torch.tensor([table], dtype=torch.int32, device="cuda"),
                         seq_lens=torch.tensor([n], dtype=torch.int32, device="cuda"), states=[seq.states])
    token = torch.tensor([seq.output_ids[-1]], device="cuda")
    plan = tool.plan(tool.stack_of(model))
    assert plan is not None
    h = tool.decode_stack(kernels, plan, torch.nn.functional.embedding(token, model.embed), ctx)
    got = model.ops.gemv_norm_logits(h, None, model.final_norm, model.cfg.rms_norm_eps, model.lm_head)
    want = model.forward(token, ctx, None)
    # the kernel's attention sums its splits in another order: bf16 noise on the logits, same argmax
    assert compare(got, want, 5e-2, 5e-2) is None and int(got.argmax()) == int(want.argmax())
