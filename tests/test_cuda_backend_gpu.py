"""The cuda backend against the torch backend on a random Qwen3-0.6B-shape model (GPU only).

Both run bf16 on the same GPU with the same weights; they differ in kernels (fused fp32 math in
one rounding vs the references' HF rounding order), so greedy tokens are compared with vLLM's
check_logprobs_close rule: equal up to the first divergence, and there each side's token is in
the other's top-5 (random models have flat distributions, so near-ties happen). Every one of the
16 KV dtypes runs this way, on every layer (no high-precision promotion) and with InnerQ
calibrating the rotated K sides, so each dtype's write / decode / prefill / WHT kernels carry
the whole generation.
Teacher-forced logits, bf16 and fp8 KV: max |diff| <= 0.1 + 5% of the logit range (bf16 noise
through 28 layers). Packed KV sides have no such bound: a one-ulp difference upstream can move a
value across a quantization boundary, a step far larger than bf16 noise; the token rule holds.
"""

from __future__ import annotations

import pytest
import torch

from hf_oracle import check_batch_decodes_as_alone, check_logprobs_close, teacher_forced
from metrale_cli.commands.bench_presets import PRESETS, random_weights
from metrale_cli.engine.runner import RunnerOptions, open_runner
from metrale_cli.engine.source import ModelSource
from metrale_cli.engine.sampler import Sampler, SamplingParams
from metrale_cli.kv.dtypes import KvCacheDtype

pytestmark = pytest.mark.gpu

PROMPT_LEN, NEW = 100, 32


@pytest.fixture(scope="module")
def weights():
    torch.manual_seed(0)
    return random_weights(PRESETS["qwen3-0.6b"], torch.device("cuda"), torch.bfloat16)


def _runner(weights, backend: str, kv: KvCacheDtype, graphs: str = "full", promote: bool = True):
    opts = RunnerOptions(backend=backend, kv_cache_dtype=kv, max_seq_len=256, max_num_seqs=4,
                         reserve_all_memory=False, prefill_chunk=37, fp8_kv_calibration_tokens=64,
                         cuda_graph_mode=graphs, kv_promote_minimum=promote, innerq_calibration_tokens=64)
    return open_runner(opts, ModelSource.loaded(PRESETS["qwen3-0.6b"], weights, None, "qwen3-0.6b"))


@pytest.mark.parametrize("kv", list(KvCacheDtype))
def test_cuda_greedy_matches_torch(weights, kv):
    _greedy_matches(weights, kv, promote=False)


@pytest.mark.parametrize("kv", [KvCacheDtype.TURBO2, KvCacheDtype.FP8K_TURBO3V])
def test_cuda_greedy_matches_torch_with_bf16_boundary_layers(weights, kv):
    """The dtype's minimum of high-precision layers: bf16 and quantized layers in one graph."""
    _greedy_matches(weights, kv, promote=True)


def _greedy_matches(weights, kv, promote):
    prompt = torch.randint(0, 151936, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    results = {}
    for backend in ("torch", "cuda"):
        runner = _runner(weights, backend, kv, promote=promote)
        seqs, _ = runner.engine.generate([prompt], params)
        ids = seqs[0].output_ids
        logits = teacher_forced(runner.engine, prompt + ids)
        results[backend] = (ids, logits[PROMPT_LEN - 1 : -1], logits)
    (t_ids, t_logits, t_all), (c_ids, c_logits, c_all) = results["torch"], results["cuda"]
    assert len(c_ids) == NEW
    same = check_logprobs_close(c_ids, c_logits, t_ids, t_logits)
    if kv not in (KvCacheDtype.BF16, KvCacheDtype.FP8):
        return
    n = PROMPT_LEN + same
    spread = (t_all[:n].max() - t_all[:n].min()).item()
    assert (c_all[:n] - t_all[:n]).abs().max().item() <= 0.1 + 0.05 * spread


def test_cuda_batch_decode_matches_single(weights):
    """decode_multi_seq with ragged contexts: each row equals that prompt decoded alone."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 151936, (n,), generator=gen).tolist() for n in (5, 77, 130)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    check_batch_decodes_as_alone(_runner(weights, "cuda", KvCacheDtype.BF16).engine, prompts, params)


@pytest.mark.parametrize("kv", [KvCacheDtype.BF16, KvCacheDtype.FP8, KvCacheDtype.TURBO4, KvCacheDtype.BF16K_TURBO2V])
def test_graph_replay_matches_eager(weights, kv):
    """The same kernels replayed from a graph: tokens equal, logits equal up to the split-K
    reduction order (the graph sizes the decode split from the pool's widest block table)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 151936, (n,), generator=gen).tolist() for n in (40, 9, 120)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    out = {}
    for mode in ("disabled", "full"):
        runner = _runner(weights, "cuda", kv, graphs=mode)
        assert runner.engine.graphs.capture == (mode == "full")
        seqs, _ = runner.engine.generate(prompts, params)
        out[mode] = [s.output_ids for s in seqs]
        if mode == "full":
            assert sorted(runner.engine.graphs.graphs) == [4]  # 3 live rows + 1 padding row
            last = runner
    for eager, graphed, p in zip(out["disabled"], out["full"], prompts):
        eager_logits = teacher_forced(last.engine, p + eager)[len(p) - 1 : -1]
        graph_logits = teacher_forced(last.engine, p + graphed)[len(p) - 1 : -1]
        check_logprobs_close(graphed, graph_logits, eager, eager_logits)


def test_graphed_pipelined_decode_stops_like_eager_step_by_step(weights):
    """Graphs and the device-side advance of the inputs, with sequences stopping at different
    steps (one on an EOS token, the others at the length limit), against eager step-by-step
    decode from host state (a batch larger than the static buffers). One bf16 path each: tokens
    and stops equal where no near-tie intervenes (check_logprobs_close)."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 151936, (n,), generator=gen).tolist() for n in (40, 9, 120)]
    graphed = _runner(weights, "cuda", KvCacheDtype.BF16)
    free = graphed.engine.generate(prompts[:1], SamplingParams(max_new_tokens=16, ignore_eos=True))[0][0]
    eos, params = free.output_ids[6], SamplingParams(max_new_tokens=16)
    piped = graphed.engine.generate(prompts, params, eos_ids=[eos])[0]
    assert piped[0].finish_reason == "eos" and "length" in {s.finish_reason for s in piped}
    eager = _runner(weights, "cuda", KvCacheDtype.BF16, graphs="disabled")
    eager.engine.graphs.buckets = []  # every batch decodes step by step from host state
    stepped = eager.engine.generate(prompts, params, eos_ids=[eos])[0]
    for a, b, p in zip(piped, stepped, prompts):
        a_logits = teacher_forced(eager.engine, p + a.output_ids)[len(p) - 1 : -1]
        b_logits = teacher_forced(eager.engine, p + b.output_ids)[len(p) - 1 : -1]
        check_logprobs_close(a.output_ids, a_logits, b.output_ids, b_logits)
        if a.output_ids == b.output_ids:
            assert a.finish_reason == b.finish_reason


def test_seeded_sampling_repeats_and_a_rows_draws_are_its_own(weights):
    """On the device, graphed and pipelined: a seeded run repeats token for token, and a seeded
    sampler's draws for a sequence are the same alone as beside other rows (the same logits)."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 151936, (n,), generator=gen).tolist() for n in (40, 9, 120)]
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    runner = _runner(weights, "cuda", KvCacheDtype.BF16)
    first, again = ([s.output_ids for s in runner.engine.generate(prompts, params)[0]] for _ in range(2))
    assert first == again and len({tuple(t) for t in first}) == 3
    logits = torch.randn(3, 151936, generator=gen).cuda()

    def draws(rows: list[int]) -> list[list[int]]:
        sampler = Sampler(params, torch.device("cuda"))
        for i in rows:
            sampler.start(i, prompts[i], logits.shape[-1])
        return torch.stack([sampler(logits[rows], rows) for _ in range(8)], dim=1).tolist()

    assert draws([0, 1, 2])[1] == draws([1])[0] == draws([2, 1])[1]
