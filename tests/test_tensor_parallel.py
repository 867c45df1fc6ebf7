"""Tensor parallelism on the CPU (gloo): N ranks in spawned processes, each holding its shard of a
tiny random model of every family, give the greedy tokens of one process (fp32) and its
teacher-forced logits within LOGITS_TOL.

The shapes are those that break naive sharding: GQA with fewer KV heads than ranks (each rank
then holds the KV head its query heads read), head_dim != hidden / heads, q/k/v and o_proj
biases (o_proj's added once), tied and untied embeddings, a vocabulary that does not split evenly
(the last rank's shard padded), dense layers among MoE ones, a MoE's shared expert, Gated DeltaNet
layers with several value heads per key head (Qwen3-Next's interleaved input projection and
Qwen3.5's split one), a prompt over several prefill chunks.
"""

from __future__ import annotations

import pytest
import torch

import tp_ranks
from hf_oracle import make_hf, random_ids
from metrale_cli.errors import MetraleError
from metrale_cli.models import model_config
from metrale_cli.engine.ranks import run_ranks
from metrale_cli.layers.parallel import TensorParallel
from metrale_cli.models.sharding import check_shardable, shard_config

# fp32 sums over the ranks' partial products in another order than one process's GEMMs: a few ulps
LOGITS_TOL = 1e-4

MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
CASES = {
    "llama-tied-odd-vocab": ("llama", 2, dict(tie_word_embeddings=True, vocab_size=383)),
    "llama-biases": ("llama", 2, dict(attention_bias=True)),
    "llama-4-ranks-2-kv-heads": ("llama", 4, {}),
    "mistral-head-dim": ("mistral", 2, dict(head_dim=24, sliding_window=None)),
    "phi3-fused-partial-rope": ("phi3", 2, dict(partial_rotary_factor=0.5)),
    "phi3-4-ranks-2-kv-heads": ("phi3", 4, {}),  # the fused rows' KV heads replicated
    "qwen2": ("qwen2", 2, dict(num_key_value_heads=1)),
    "qwen3-head-dim": ("qwen3", 2, dict(head_dim=24)),
    "qwen3_moe-dense-layer": ("qwen3_moe", 2, dict(head_dim=16, num_experts=6, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, norm_topk_prob=True,
                                                   mlp_only_layers=[1])),
    "qwen2_moe-shared": ("qwen2_moe", 2, MOE),
    "qwen3_next": ("qwen3_next", 2, dict(num_hidden_layers=4, head_dim=32, partial_rotary_factor=0.5) | GDN | MOE),
    "qwen3_5_text": ("qwen3_5_text", 2, dict(num_hidden_layers=4, head_dim=32, tie_word_embeddings=True) | GDN),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", 2, dict(num_hidden_layers=4, head_dim=32) | GDN | MOE),
}


def _perturbed(hf, seed: int) -> dict[str, torch.Tensor]:
    """The model's tensors with every norm and bias moved off its initial value (zero-centred
    norms start at 0, biases at 0), so a norm or bias a rank drops or double-counts shows."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in hf.state_dict().items():
        t = t.detach().float().clone()
        if "norm" in name or name.endswith(".bias"):
            t += 0.1 * torch.randn(t.shape, generator=gen)
        out[name] = t
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_give_one_process_greedy_tokens_and_logits(case):
    family, ranks, overrides = CASES[case]
    hf, raw = make_hf(family, seed=3, **overrides)
    tensors = _perturbed(hf, seed=4)
    prompt = random_ids(19, seed=5, vocab=raw["vocab_size"])
    one_ids, one_logits = run_ranks(1, tp_ranks.greedy, raw, tensors, prompt, 6)
    ids, logits = run_ranks(ranks, tp_ranks.greedy, raw, tensors, prompt, 6)
    assert ids == one_ids
    assert logits.shape == one_logits.shape == (6, raw["vocab_size"])
    err = (logits - one_logits).abs().max().item()
    assert err <= LOGITS_TOL * max(1.0, one_logits.abs().max().item()), err


# Batch 1's fused row path (the cuda backend's GEMVs with the norm and the residual add fused in,
# here their torch references): the families whose attention takes it (no q/k/v bias).
ROW_PATH_CASES = ["llama-4-ranks-2-kv-heads", "mistral-head-dim", "qwen3-head-dim", "qwen3_moe-dense-layer",
                  "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]


@pytest.mark.parametrize("case", ROW_PATH_CASES)
def test_ranks_take_the_fused_row_path_and_add_the_residual_once(case):
    """At batch 1 every layer of every rank takes the fused row path, where rank 0 alone adds the
    residual in the projection and the all-reduce follows it: the greedy tokens of one process
    (fp32), and each decode step's log-probabilities (the token's and the five likeliest) within
    LOGITS_TOL. (With the residual added on every rank the tokens part at the first decode step.)"""
    family, ranks, overrides = CASES[case]
    hf, raw = make_hf(family, seed=3, **overrides)
    tensors = _perturbed(hf, seed=4)
    prompt = random_ids(19, seed=5, vocab=raw["vocab_size"])
    one_ids, one_lp, one_path = run_ranks(1, tp_ranks.greedy_row_path, raw, tensors, prompt, 8)
    ids, lp, path = run_ranks(ranks, tp_ranks.greedy_row_path, raw, tensors, prompt, 8)
    assert all(one_path) and all(path) and len(path) == raw["num_hidden_layers"]
    assert ids == one_ids
    for got, want in zip(lp[1:], one_lp[1:]):  # the decode steps' (the first token is the prefill's)
        assert [t for t, _ in got["top"]] == [t for t, _ in want["top"]]
        values = [(got["logprob"], want["logprob"])] + [(a, b) for (_, a), (_, b) in zip(got["top"], want["top"])]
        assert all(abs(a - b) <= LOGITS_TOL * max(1.0, abs(b)) for a, b in values), values


def test_a_shard_config_divides_heads_widths_and_vocabulary():
    _, raw = make_hf("qwen3_next", **(dict(num_hidden_layers=4, head_dim=32) | GDN | MOE))
    cfg = model_config(raw)
    shard = shard_config(cfg, TensorParallel(1, 2))
    attention = next(s for s in shard.layers if s.attention is not None).attention
    gdn = next(s for s in shard.layers if s.gdn is not None).gdn
    moe = shard.layers[0].ffn.moe
    assert (attention.num_heads, attention.num_kv_heads) == (2, 1)
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim) == (1, 2, 16)
    assert (moe.expert_size, moe.shared_expert_size, moe.num_experts, moe.top_k) == (16, 24, 6, 2)
    assert shard.vocab_rows == (cfg.vocab_size + 1) // 2 and shard.vocab_size == cfg.vocab_size


@pytest.mark.parametrize("ranks, overrides, names", [
    (3, {}, "attention heads (4)"),
    (8, {}, "attention heads (4)"),
    (2, dict(intermediate_size=127), "FFN width (127)"),
    (4, dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=3, head_dim=8), "KV heads (3: 4 ranks"),
    (4, dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=8), "KV heads (6)"),
])
def test_a_size_that_does_not_divide_the_model_is_one_error(ranks, overrides, names):
    _, raw = make_hf("llama", **overrides)
    with pytest.raises(MetraleError, match="does not divide") as e:
        check_shardable(model_config(raw), ranks)
    assert names in e.value.message and e.value.hint


def test_a_failing_rank_zero_stops_the_others():
    """Rank 0's start-up error (every rank refuses the 3-way split) is raised here, once; the
    spawned ranks are stopped, not left waiting for it."""
    hf, raw = make_hf("llama")
    with pytest.raises(MetraleError, match="does not divide"):
        run_ranks(3, tp_ranks.greedy, raw, _perturbed(hf, 0), [1, 2, 3], 2)


def test_a_failing_worker_is_one_error_and_no_hang():
    """A spawned rank's start-up error reaches rank 0, which is waiting in an all-reduce that rank
    never joins: raised there as that rank's one error (its message and hint), within seconds."""
    with pytest.raises(MetraleError, match="rank one cannot start") as e:
        run_ranks(2, tp_ranks.fails_on_rank_one)
    assert e.value.hint == "a hint for rank one"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from helpers_checkpoints import make_hf_checkpoint

    return str(make_hf_checkpoint(tmp_path_factory.mktemp("tp"), "qwen3"))


def _cli(*args):
    from typer.testing import CliRunner

    from metrale_cli.cli import app

    return CliRunner().invoke(app, list(args))


def test_generate_on_two_ranks_writes_what_one_process_writes(checkpoint):
    """``metrale generate -tp 2`` (fp32, greedy): rank 0's JSON output, the same token ids as one
    process's."""
    import json

    common = ["generate", "-m", checkpoint, "--backend", "torch", "--dtype", "fp32", "-n", "8", "--ignore-eos",
              "--json", "The quick brown fox"]
    one, two = _cli(*common), _cli(*common, "-tp", "2")
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    ids = [json.loads(r.stdout)["results"][0]["token_ids"] for r in (one, two)]
    assert ids[0] == ids[1] and len(ids[0]) == 8


def test_bench_on_two_ranks_reports_one_ranks_shard(checkpoint):
    import json

    got = _cli("bench", "-m", checkpoint, "--backend", "torch", "-p", "8", "-n", "4", "-r", "1", "--json", "-tp", "2")
    assert got.exit_code == 0, got.output
    result = json.loads(got.stdout)
    assert result["tensor_parallel_size"] == 2 and [r["test"] for r in result["rows"]] == ["pp8", "tg4 b1 @8"]
    refused = _cli("bench", "-m", checkpoint, "--backend", "torch", "--compare-hf", "-tp", "2")
    assert refused.exit_code == 1 and "error: --compare-hf" in refused.output


@pytest.mark.parametrize("size, message", [("0", "must be at least 1"), ("3", "does not divide")])
def test_a_bad_size_is_one_error_line(checkpoint, size, message):
    got = _cli("generate", "-m", checkpoint, "--backend", "torch", "-n", "2", "-tp", size, "hi")
    assert got.exit_code == 1
    errors = [line for line in got.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], got.output


@pytest.mark.parametrize("command, args, message", [
    ("generate", ["--all-reduce", "ring"], "unknown --all-reduce 'ring'"),
    ("generate", ["--all-reduce", "one-shot"], "this run has one"),
    ("generate", ["--all-reduce", "one-shot", "-tp", "2"], "runs on the cuda backend"),
    ("bench", ["--all-reduce", "one-shot", "-tp", "2"], "runs on the cuda backend"),
])
def test_an_all_reduce_that_cannot_run_is_one_error_line(checkpoint, command, args, message):
    prompt = ["hi"] if command == "generate" else ["-p", "8", "-n", "2", "-r", "1"]
    got = _cli(command, "-m", checkpoint, "--backend", "torch", "-n", "2", *args, *prompt)
    assert got.exit_code == 1
    errors = [line for line in got.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], got.output


def test_bench_profile_reports_the_all_reduces_of_a_decode_step(checkpoint):
    """Two layers: each sums its attention and its FFN over the ranks, and the embedding is summed
    once: five all-reduces a decode step (the LM head's logits are gathered, not summed)."""
    got = _cli("bench", "-m", checkpoint, "--backend", "torch", "-p", "8,12", "-n", "4", "-r", "1", "--profile",
               "-tp", "2")
    assert got.exit_code == 0, got.output
    for n in (8, 12):  # a profile for each point of the sweep
        assert f"top kernels, metrale torch eager kv=bf16 tg4 b1 @{n} (one pp + tg repetition):" in got.output
    line = next(x for x in got.output.splitlines() if x.startswith("all-reduce in the decode steps:"))
    assert line.startswith("all-reduce in the decode steps: 5 a step, ") and "host time, 2 ranks" in line
    assert float(line.split(", ")[1].split(" µs")[0]) > 0


def test_the_sharder_cuts_each_tensor_as_read():
    """Per-expert tensors (before they are stacked), a vision-language checkpoint's text names,
    the vocabulary's padded last shard; a part is a copy (the full tensor can be freed), a
    replicated tensor is passed on as it is, a mis-shaped one is one error line."""
    from metrale_cli.models.sharding import Sharder

    _, raw = make_hf("qwen3_moe", head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                     vocab_size=383)
    cfg = model_config(raw)
    last = Sharder(cfg, TensorParallel(1, 2))
    gate = torch.arange(32 * 64, dtype=torch.float32).view(32, 64)
    part = last("model.layers.0.mlp.experts.5.gate_proj.weight", gate)
    assert torch.equal(part, gate[16:]) and part.untyped_storage().nbytes() == part.nbytes
    down = torch.randn(64, 32)
    assert torch.equal(last("model.layers.1.mlp.experts.0.down_proj.weight", down), down[:, 16:])
    embed = torch.randn(383, 64)
    rows = last("model.embed_tokens.weight", embed)
    assert rows.shape == (192, 64) and torch.equal(rows[:191], embed[192:]) and not rows[191].any()
    q = torch.randn(64, 64)  # 4 heads of 16
    assert torch.equal(last("model.language_model.layers.0.self_attn.q_proj.weight", q), q[32:])
    norm = torch.randn(64)
    assert last("model.norm.weight", norm) is norm
    with pytest.raises(MetraleError, match="has shape"):
        last("model.layers.0.self_attn.o_proj.weight", torch.randn(64, 60))


def test_the_70b_preset_halves_over_two_ranks():
    """llama3.1-70b (141.1 GB in bf16) at TP=2: 32 of 64 query heads and 4 of 8 KV heads a rank,
    half of every width and of the vocabulary: each rank's expected tensors hold half the bytes."""
    import math

    from metrale_cli.commands.bench_presets import PRESETS
    from metrale_cli.models import family_of

    cfg = model_config(PRESETS["llama3.1-70b"])
    family = family_of(cfg.family)
    full = sum(math.prod(s) for s in family.expected_tensors(cfg).values())
    shard = shard_config(cfg, TensorParallel(1, 2))
    half = sum(math.prod(s) for s in family.expected_tensors(shard).values())
    a = shard.layers[0].attention
    assert (a.num_heads, a.num_kv_heads, shard.layers[0].ffn.intermediate_size) == (32, 4, 14336)
    assert round(full * 2 / 1e9, 1) == 141.1
    # norms are replicated: a rank holds half of everything else
    assert abs(half - full / 2) <= 81 * cfg.hidden_size
