"""Engine behaviour: pool admission, exhaustion errors, sampling rules, stop-string streaming."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import make_hf, ours, teacher_forced
from metrale_cli.engine.sampler import Sampler, SamplingParams
from metrale_cli.engine.sequence import StopText
from metrale_cli.errors import MetraleError
from metrale_cli.kv.paged import BlockAllocator


def _ids(n, seed=0):
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_sequence_larger_than_pool_is_an_error_up_front():
    hf, raw = make_hf("llama")
    engine = ours(hf, raw, blocks=2)  # 32 tokens
    with pytest.raises(MetraleError, match="KV cache pool exhausted"):
        engine.generate([_ids(30)], SamplingParams(max_new_tokens=8))


def test_prompts_wait_for_blocks_and_finish_equal_to_alone():
    hf, raw = make_hf("llama")
    prompts = [_ids(20, s) for s in range(3)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    tight = ours(hf, raw, blocks=2)  # one 30-token sequence at a time
    waves = [s.output_ids for s in tight.generate(prompts, params)[0]]
    assert tight.model.kv_cache.allocator.free_blocks == 2  # everything released
    alone = [ours(hf, raw).generate([p], params)[0][0].output_ids for p in prompts]
    assert waves == alone


def test_a_token_past_the_vocabulary_is_an_error_up_front():
    hf, raw = make_hf("llama")
    engine = ours(hf, raw)
    vocab = engine.model.cfg.vocab_size
    with pytest.raises(MetraleError) as info:
        engine.generate([_ids(5), [1, vocab, 2]], SamplingParams(max_new_tokens=2))
    assert info.value.message == (f"prompt 2: token id {vocab} is past the model's vocabulary of {vocab} tokens: "
                                  "the tokenizer does not match the checkpoint")


def test_allocator_exhaustion_message():
    alloc = BlockAllocator(4)
    assert alloc.allocate(3) == [0, 1, 2]
    with pytest.raises(MetraleError, match="need 2 more blocks of 16 tokens, 1 free of 4"):
        alloc.allocate(2)


def test_eos_stops_generation():
    hf, raw = make_hf("qwen3", head_dim=32)
    prompt = _ids(12)
    free = ours(hf, raw).generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0][0]
    eos = free.output_ids[5]
    first = free.output_ids.index(eos)
    seq = ours(hf, raw).generate([prompt], SamplingParams(max_new_tokens=12), eos_ids=[eos])[0][0]
    assert seq.finish_reason == "eos" and seq.output_ids == free.output_ids[: first + 1]


def test_pipelined_decode_equals_step_by_step_decode():
    """Batches the static buffers hold decode pipelined: the next step is launched from inputs
    advanced on the device before the host reads this step's tokens, so a sequence that stops
    runs one step too many (dropped). Larger batches decode step by step from host state. Both
    give the same tokens and stops, whichever sequence finishes when."""
    hf, raw = make_hf("qwen3", head_dim=32)
    prompts = [_ids(n, s) for s, n in enumerate((12, 5, 30, 17))]
    free = ours(hf, raw, dtype=torch.float32).generate(
        prompts[:1], SamplingParams(max_new_tokens=12, ignore_eos=True))[0][0]
    eos, params = free.output_ids[4], SamplingParams(max_new_tokens=12)
    piped, stats = ours(hf, raw, dtype=torch.float32).generate(prompts, params, eos_ids=[eos])
    stepped = ours(hf, raw, dtype=torch.float32, max_batch=1).generate(prompts, params, eos_ids=[eos])[0]
    assert [s.output_ids for s in piped] == [s.output_ids for s in stepped]
    assert [s.finish_reason for s in piped] == [s.finish_reason for s in stepped]
    assert piped[0].finish_reason == "eos" and len(piped[0].output_ids) <= 5
    assert "length" in {s.finish_reason for s in piped}
    assert stats.decode_tokens == sum(len(s.output_ids) - 1 for s in piped)  # dropped ones uncounted


@pytest.mark.parametrize("lengths, steps", [((20,), 4), ((20, 9, 33), 4), ((40,), 2)])
def test_no_step_is_launched_behind_one_that_ends_every_sequence(lengths, steps):
    """A pipelined step that brings every running sequence to its last token (max_new_tokens, or
    the context: 43 tokens here) has no step launched behind it: 5 new tokens are the prefill's
    and 4 decode steps (the 40-token prompt: its prefill's and 2 steps, then the context)."""
    hf, raw = make_hf("qwen3", head_dim=32)
    engine = ours(hf, raw)
    engine.max_seq_len = 43
    launched = []
    launch = engine.launch
    engine.launch = lambda seqs, *a: launched.append(len(seqs)) or launch(seqs, *a)
    seqs = engine.generate([_ids(n, n) for n in lengths], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert [s.finish_reason for s in seqs] == ["length" if n + 5 <= 43 else "context" for n in lengths]
    assert len(launched) == steps, launched


def test_top_p_and_top_k_restrict_the_draw():
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]])
    draws = {int(Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=s), torch.device("cpu"))(logits))
             for s in range(40)}
    assert draws == {0}  # token 0 alone holds > 50% of the mass
    draws = {int(Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s), torch.device("cpu"))(logits))
             for s in range(40)}
    assert draws == {0, 1}


def test_bad_sampling_values_are_user_errors():
    for kwargs in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_new_tokens": 0}):
        with pytest.raises(MetraleError):
            SamplingParams(**kwargs)


class _Pieces:
    def __init__(self, pieces):
        self.pieces = pieces

    def push(self, token):
        return self.pieces[token]

    def flush(self):
        return ""


def test_stop_text_holds_back_a_possible_stop_prefix():
    text = StopText(_Pieces(["Hel", "lo E", "ND more"]), stop=("END",))
    # len("END") - 1 = 2 characters stay held back while they could begin the stop string
    assert [text.push(0), text.push(1)] == ["H", "ello"]
    assert text.push(2) == " "
    assert text.stopped and text.text == "Hello "


def test_decode_advance_reference_takes_torch_argmax_and_moves_live_rows_on():
    """The contract of Ops.decode_advance on its fixture: the first of three tied maxima, a NaN,
    -0.0 before +0.0; a row not live keeps its position and gets slot -1; a new block; a position
    one block past the table takes the table's last block; rows past the step are untouched."""
    from metrale_cli.kernels import reference as ref
    from metrale_cli.kernels.cases import decode_advance_case, step_to

    logits, step = decode_advance_case()
    before = step_to(step, "cpu")
    ref.decode_advance(logits, step, 6)
    t = step.tables
    assert step.next_tokens[:6].tolist() == [17, 12345, 70] + logits[3:6].argmax(-1).tolist()
    assert step.tokens.tolist() == step.next_tokens[:6].tolist() + [-7, -7]
    assert step.positions.tolist() == [4, 21, 41, 9, 16, 48, 5, 5]
    assert step.seq_lens.tolist() == [5, 22, 42, 10, 17, 49, 6, 6]
    assert step.slots.tolist() == [t[0, 0] * 16 + 4, t[1, 1] * 16 + 5, t[2, 2] * 16 + 9, -1, t[4, 1] * 16,
                                   t[5, 2] * 16, -9, -9]
    assert torch.equal(step.next_tokens[6:], before.next_tokens[6:])
    # tokens sampled already: next_tokens is taken as it is, the rows move on alike
    sampled = step_to(before, "cpu")
    ref.decode_advance(None, sampled, 6)
    assert torch.equal(sampled.next_tokens, before.next_tokens)
    assert sampled.tokens.tolist() == before.next_tokens[:6].tolist() + [-7, -7]
    assert all(torch.equal(getattr(sampled, f), getattr(step, f)) for f in ("positions", "seq_lens", "slots"))


def test_every_rows_logits_without_a_gather_equal_the_gathered_ones():
    """forward(..., None), as a decode step calls it, returns every row's logits unchanged."""
    hf, raw = make_hf("qwen3", head_dim=32)
    engine = ours(hf, raw, dtype=torch.float32)
    ids = _ids(21, 3)
    picked, whole = teacher_forced(engine, ids), teacher_forced(engine, ids, gather=False)
    assert whole.shape == (21, raw["vocab_size"]) and torch.equal(picked, whole)
