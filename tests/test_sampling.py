"""The sampling knobs against references: the repetition, presence and frequency penalties
against a plain per-token loop (and the repetition penalty and min-p against HF's own logits
processors), greedy decoding with a repetition penalty against HF's generate in fp32, and
generate's samples per prompt."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from hf_oracle import hf_kv_rounded_to_bf16, make_hf, ours
from metrale_cli.engine.sampler import Sampler, SamplingParams, apply_penalties, warped_probs
from metrale_cli.errors import MetraleError


def _reference(logits, prompt, output, p: SamplingParams):
    """One logit at a time, as the definitions read."""
    out = logits.clone()
    for t in range(out.shape[0]):
        value = out[t].item()
        if t in prompt or t in output:
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        count = output.count(t)
        value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        out[t] = value
    return out


@pytest.mark.parametrize("rep, presence, frequency", [(1.3, 0.0, 0.0), (0.8, 0.5, 0.25), (1.0, -0.4, 1.5)])
def test_the_penalties_equal_their_definitions(rep, presence, frequency):
    g = torch.Generator().manual_seed(3)
    vocab = 50
    params = SamplingParams(repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency)
    histories = [([3, 7, 7, 11], [7, 20, 20, 20, 4]), ([], [1]), ([0, 49], [])]
    logits = torch.randn(len(histories), vocab, generator=g) * 3
    seen = torch.zeros(len(histories), vocab, dtype=torch.bool)
    counts = torch.zeros(len(histories), vocab)
    for row, (prompt, output) in enumerate(histories):
        seen[row, prompt + output] = True
        for t in output:
            counts[row, t] += 1
    got = apply_penalties(logits, seen, counts, params)
    for row, (prompt, output) in enumerate(histories):
        assert torch.allclose(got[row], _reference(logits[row], prompt, output, params), atol=1e-6, rtol=0)


def test_the_repetition_penalty_equals_hfs_logits_processor():
    g = torch.Generator().manual_seed(4)
    ids = torch.tensor([[5, 9, 9, 31, 2]])
    logits = torch.randn(1, 40, generator=g) * 2
    seen = torch.zeros(1, 40, dtype=torch.bool)
    seen[0, ids[0]] = True
    got = apply_penalties(logits, seen, torch.zeros(1, 40), SamplingParams(repetition_penalty=1.7))
    want = T.RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    assert torch.equal(got, want)


def test_the_sampler_tracks_each_sequence_and_counts_what_it_picked():
    """Greedy with a frequency penalty, two sequences in rows of changing order: each row's
    choice equals the reference's given that sequence's own history."""
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(frequency_penalty=0.6, repetition_penalty=1.2)
    sampler = Sampler(params, torch.device("cpu"))
    prompts = {0: [1, 2, 3], 1: [4]}
    outputs = {0: [], 1: []}
    for index, prompt in prompts.items():
        sampler.start(index, prompt, 12)
    for order in ([0, 1], [1, 0], [0, 1], [1], [0, 1]):
        logits = torch.randn(len(order), 12, generator=g)
        tokens = sampler(logits, order)
        for row, index in enumerate(order):
            want = int(_reference(logits[row], prompts[index], outputs[index], params).argmax())
            assert int(tokens[row]) == want
            outputs[index].append(want)


def test_min_p_keeps_what_hfs_warper_keeps():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 64, generator=g) * 2
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.2, seed=0), torch.device("cpu"))
    kept = T.MinPLogitsWarper(0.2)(None, logits.clone()) > float("-inf")
    for _ in range(200):
        tokens = sampler(logits)
        assert kept[torch.arange(4), tokens].all()
    assert (kept.sum(-1) < 64).all()  # the warper does drop tokens here


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999, 0.9999])
def test_top_p_keeps_what_hfs_warper_keeps_over_a_whole_vocab(top_p):
    """Over Qwen3's 151,936 tokens, where a sum from the likeliest token drifts by ~1e-5 near 1:
    the kept tokens are HF's TopPLogitsWarper's, which are those of the same rule in float64."""
    logits = torch.randn(4, 151936, generator=torch.Generator().manual_seed(8)) * 3
    kept = warped_probs(logits, SamplingParams(temperature=1.0, top_p=top_p)) > 0
    assert torch.equal(kept, T.TopPLogitsWarper(top_p)(None, logits.clone()) > float("-inf"))
    ordered, order = logits.double().sort(dim=-1, descending=True)
    p = ordered.softmax(dim=-1)
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, order, p.cumsum(dim=-1) - p < top_p))


@pytest.mark.parametrize("temperature", [1e-39, 1e-45])
def test_a_tiny_temperature_samples_the_likeliest_token(temperature):
    """30 / 1e-39 overflows to inf (-40 to -inf): the draw must still be the argmax,
    not a NaN distribution that multinomial refuses."""
    logits = torch.tensor([[30.0, 29.0, -5.0, 12.0], [-40.0, -3.0, -30.0, -8.0]])
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=0.9, min_p=0.1, seed=0), torch.device("cpu"))
    assert [sampler(logits).tolist() for _ in range(5)] == [[0, 1]] * 5


@pytest.mark.parametrize("seed", [None, 11])
def test_a_draw_follows_the_filtered_distribution(seed):
    """The exponential race picks each kept token at its probability (renormalized over what
    top-k keeps), seeded (a stream a row) or not (one stream): 20000 draws over 2 rows."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0], [0.5, 0.5, 0.0, 3.0, -2.0]])
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=4, seed=seed), torch.device("cpu"))
    counts = torch.zeros(2, 5)
    for _ in range(10000):
        tokens = sampler(torch.cat([logits, logits]))
        counts.index_put_((torch.arange(4) % 2, tokens), torch.ones(4), accumulate=True)
    kept = logits.masked_fill(logits < logits.topk(4, dim=-1).values[:, -1:], float("-inf"))
    want = (kept / 0.8).softmax(dim=-1)
    assert counts[:, 4].sum() == 0  # the token top-k drops is never drawn
    assert torch.allclose(counts / 20000, want, atol=0.012), (counts / 20000, want)


def _draws(prompts: list[list[int]], logits: torch.Tensor, order: list[int], steps: int, seed: int):
    """Each sequence's tokens over ``steps`` calls, its rows given in ``order`` (sequence indices)."""
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=seed), torch.device("cpu"))
    for i in order:
        sampler.start(i, prompts[i], logits.shape[-1])
    out = {i: [] for i in order}
    for step in range(steps):
        batch = order[step % len(order):] + order[: step % len(order)]  # the rows in turns
        for i, t in zip(batch, sampler(logits[batch], batch).tolist()):
            out[i].append(t)
    return [out[i] for i in order]


def test_a_seeded_sequence_draws_the_same_alone_or_batched():
    """With a seed a sequence's draws depend on the seed, its prompt and which copy of that prompt
    it is: not on the other rows, their order, or the sequence's index."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 50, generator=g)
    prompts = [[5, 6, 7], [1], [5, 6, 7], [2, 3]]
    together = _draws(prompts, logits, [0, 1, 2, 3], 24, seed=3)
    alone = _draws([prompts[1]], logits[1:2], [0], 24, seed=3)
    assert together[1] == alone[0]
    reversed_ = _draws(prompts[::-1], logits.flip(0), [0, 1, 2, 3], 24, seed=3)
    assert reversed_[0] == together[3] and reversed_[2] == together[1]
    assert reversed_[1] != together[2]  # [5, 6, 7]'s first copy started (copy 0) now decodes logits[2]
    assert together[0] != together[2]  # two copies of one prompt draw from two streams
    assert _draws(prompts, logits, [0, 1, 2, 3], 24, seed=4)[1] != together[1]


@pytest.mark.parametrize("bad", [dict(repetition_penalty=0.0), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=-3.0), dict(min_p=1.5), dict(stop=("end", "")),
                                 dict(seed=2**64), dict(seed=-2**63 - 1)])
def test_out_of_range_knobs_are_refused(bad):
    with pytest.raises(MetraleError):
        SamplingParams(**bad)


def test_greedy_with_a_repetition_penalty_equals_hfs_generate_in_fp32():
    hf, raw = make_hf("qwen3", seed=3)
    prompt = [5, 17, 17, 90, 3, 3, 3, 41, 7]
    ids = torch.tensor([prompt])
    with hf_kv_rounded_to_bf16():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                           repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine = ours(hf, raw, dtype=torch.float32, chunk=4)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.8)
    got = engine.generate([prompt], params)[0][0].output_ids
    plain = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0][0].output_ids
    assert got == want and got != plain  # the penalty changed the tokens, as HF's did


def test_logprobs_equal_hfs_log_softmax_of_its_logits_in_fp32():
    """--logprobs 3: each generated token's log-probability and the 3 likeliest tokens', against
    log_softmax of HF's own logits at each step (fp32, greedy, the same tokens); the first token
    comes from the prefill, the rest from decode steps."""
    from hf_oracle import hf_greedy

    hf, raw = make_hf("qwen3", seed=4)
    prompt = [11, 5, 29, 7, 7, 64]
    with hf_kv_rounded_to_bf16():
        want_ids, want_logits = hf_greedy(hf, prompt, 6)
    engine = ours(hf, raw, dtype=torch.float32, chunk=4)
    (seq,), _ = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=3))
    assert seq.output_ids == want_ids and len(seq.logprobs) == 6
    for token, got, logits in zip(want_ids, seq.logprobs, want_logits):
        lp = torch.log_softmax(logits.float(), -1)
        assert abs(got["logprob"] - lp[token].item()) < 1e-3  # fp32 sums in another order
        top = lp.topk(3)
        assert [t for t, _ in got["top"]] == top.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(got["top"], top.values.tolist())) < 1e-3
        assert got["top"][0][0] == token  # greedy: the likeliest token is the one taken


def test_logprobs_of_logits_that_are_not_finite_are_an_error():
    """A NaN in the final norm's weight (tensors handed over in memory are not checked as a
    file's are): the run stops with one error rather than printing NaN log-probabilities (and
    JSON that is not JSON)."""
    hf, raw = make_hf("qwen3", seed=4)
    with torch.no_grad():
        hf.model.norm.weight[3] = float("nan")
    engine = ours(hf, raw, dtype=torch.float32, chunk=4)
    with pytest.raises(MetraleError, match="the model's logits are not finite"):
        engine.generate([[11, 5, 29]], SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=1))
    # bench --kv-quality's teacher-forced log-probabilities, which a KL and a perplexity are made of
    from types import SimpleNamespace

    from metrale_cli.commands.kv_quality import teacher_forced_logprobs
    from metrale_cli.kv.dtypes import KvCacheDtype

    with pytest.raises(MetraleError, match="the model's logits are not finite .* with a bf16 KV cache"):
        teacher_forced_logprobs(SimpleNamespace(engine=engine, kv_dtype=KvCacheDtype.BF16), [11, 5, 29])


def test_decode_speed_leaves_graph_capture_out(monkeypatch):
    """Graph capture made to take 0.3 s (a stand-in graph that replays the eager step): the run's
    decode time leaves every capture out and counts it apart, and the tokens are the eager ones."""
    import time

    from metrale_cli.engine.cuda_graphs import DecodeGraphs

    hf, raw = make_hf("qwen3", seed=5)
    engine = ours(hf, raw, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = engine.generate([[3, 4, 5]], params)[0][0].output_ids

    class Replay:
        def __init__(self, step):
            self.replay = step

    def capture(graphs, b):
        time.sleep(0.3)
        out = graphs.model.forward(*graphs._args(b)).clone()  # a tensor the stand-in replay writes
        return Replay(lambda: out.copy_(graphs.model.forward(*graphs._args(b)))), out

    def capture_advance(graphs, b, greedy):
        time.sleep(0.3)
        return Replay(lambda: graphs._advance(b, greedy))

    monkeypatch.setattr(DecodeGraphs, "graphed", lambda self: True)
    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    monkeypatch.setattr(DecodeGraphs, "_capture_advance", capture_advance)
    start = time.perf_counter()
    (seq,), stats = engine.generate([[3, 4, 5]], params)
    total = time.perf_counter() - start
    assert seq.output_ids == want
    assert stats.capture_seconds >= 0.6  # the step's graph and the greedy advance's, one bucket
    assert stats.decode_seconds <= total - stats.prompt_seconds - stats.capture_seconds + 1e-3
