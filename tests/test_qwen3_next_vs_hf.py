"""The Qwen3-Next hybrid on the torch backend against HF transformers, on tiny random models: Gated
DeltaNet layers (value heads a multiple of the key heads) among gated full-attention layers with
partial RoPE, QK-norm and GQA, MoE FFNs with a shared expert among dense ones.

The GDN math is checked first on its own: the recurrent and the chunked (WY) forms of the gated
delta rule agree with each other and with HF's torch_* functions at odd lengths, the conv and the
norms equal HF's. Model tolerances are test_moe_vs_hf's: fp32 greedy tokens equal to HF (HF's
K/V rounded to bf16 as our cache stores them), bf16 greedy tokens by check_logprobs_close.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers as T
from gdn_cases import rule_inputs
from helpers_checkpoints import make_hf_checkpoint
from hf_oracle import (
    check_bf16_greedy_near_hf,
    check_bf16_logits_near_hf,
    check_chunked_prefill,
    check_fp32_greedy_equals_hf,
    hf_folder_greedy,
    make_hf,
    ours,
    random_ids,
    teacher_forced,
)
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

import metrale_cli.api as metrale
from metrale_cli.engine.runner import RunnerOptions, plan
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.errors import MetraleError
from metrale_cli.kernels import gdn_reference as gdn
from metrale_cli.kernels.reference import rms_norm
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.layers.spec import unserved
from metrale_cli.models import model_config

GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# case -> (config overrides, each layer's mixer, each layer's FFN kind); hidden 64, 4 heads
CASES = {
    # three GDN layers then gated attention (full_attention_interval 4), GQA 2, half the head rotated
    "hybrid-moe": ({"num_hidden_layers": 4, "head_dim": 32, "partial_rotary_factor": 0.5} | GDN | MOE,
                   ["gdn", "gdn", "gdn", "attention"], ["moe"] * 4),
    # attention first and last (layer_types), dense layers among MoE ones, GQA 4, rotary 0.25 at
    # head_dim 64 (the real model's fraction), one value head per key head, tied embeddings
    "mixed-dense": ({"num_hidden_layers": 5, "head_dim": 64, "num_key_value_heads": 1, "tie_word_embeddings": True,
                     "layer_types": ["full_attention", "linear_attention", "linear_attention", "linear_attention",
                                     "full_attention"], "mlp_only_layers": [1], "decoder_sparse_step": 1,
                     "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 32,
                     "linear_value_head_dim": 16} | MOE,
                    ["attention", "gdn", "gdn", "gdn", "attention"], ["moe", "swiglu", "moe", "moe", "moe"]),
}


def _hf(case: str, seed: int = 0):
    hf, raw = make_hf("qwen3_next", seed=seed, **CASES[case][0])
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # zero-centred norms start at 0 and the gated norm at 1: move them all
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    return hf, raw


# --- the GDN math on its own ------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 7, 63, 64, 65, 200])
def test_the_recurrent_and_chunked_forms_agree_and_equal_hfs(tokens):
    q, k, v, g, beta, state = rule_inputs(tokens, seed=tokens)
    s_rec, s_chunk = state.clone(), state.clone()
    rec = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, s_rec)
    chunk = gdn.chunked_gated_delta_rule(q, k, v, g, beta, s_chunk)
    assert (rec - chunk).abs().max() < 2e-5 and (s_rec - s_chunk).abs().max() < 2e-5
    hf_kwargs = dict(initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    hf_chunk, hf_s_chunk = hf_next.torch_chunk_gated_delta_rule(q, k, v, g, beta, **hf_kwargs)
    hf_rec, hf_s_rec = hf_next.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **hf_kwargs)
    assert (chunk - hf_chunk).abs().max() < 1e-6 and (s_chunk - hf_s_chunk).abs().max() < 1e-6
    assert (rec - hf_rec).abs().max() < 1e-6 and (s_rec - hf_s_rec).abs().max() < 1e-6


def test_the_chunked_form_continues_a_state_across_calls():
    q, k, v, g, beta, state = rule_inputs(150, seed=3)
    whole_state, parts_state = state.clone(), state.clone()
    whole = gdn.chunked_gated_delta_rule(q, k, v, g, beta, whole_state)
    cuts = [0, 7, 71, 72, 150]
    parts = [gdn.chunked_gated_delta_rule(*(x[:, a:b] for x in (q, k, v, g, beta)), parts_state)
             for a, b in itertools.pairwise(cuts)]
    assert (torch.cat(parts, dim=1) - whole).abs().max() < 2e-5 and (parts_state - whole_state).abs().max() < 2e-5


def test_the_conv_and_norms_equal_hfs():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(9, 24, generator=g), torch.randn(24, 4, generator=g)
    window = torch.zeros(3, 24)
    first = gdn.causal_conv1d(x[:5], window, weight)  # a prefill chunk, then one token at a time
    steps = []
    for t in range(5, 9):
        out, windows = gdn.causal_conv1d_step(x[t : t + 1], window[None], weight)
        window.copy_(windows[0])
        steps.append(out)
    want = hf_next.causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    assert (torch.cat([first, *steps]) - want).abs().max() < 1e-6
    for dtype in (torch.float32, torch.bfloat16):
        h, z = torch.randn(6, 8, generator=g).to(dtype), torch.randn(6, 8, generator=g).to(dtype)
        gated = hf_next.Qwen3NextRMSNormGated(8, eps=1e-6).to(dtype)
        zero_centred = hf_next.Qwen3NextRMSNorm(8, eps=1e-6)
        with torch.no_grad():
            gated.weight.copy_(1 + 0.1 * torch.randn(8, generator=g))
            zero_centred.weight.copy_(0.1 * torch.randn(8, generator=g))
        with torch.no_grad():
            assert torch.equal(gdn.gated_rms_norm(h, z, gated.weight, 1e-6), gated(h, z))
    h = torch.randn(6, 8, generator=g)  # in fp32, (1 + w) added at load time is HF's norm bit for bit
    with torch.no_grad():
        assert torch.equal(rms_norm(h, zero_centred.weight + 1.0, 1e-6), zero_centred(h))


# --- the model against HF -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_layer_specs_are_the_layers_hf_builds(case):
    hf, raw = _hf(case)
    cfg = model_config(raw)
    assert [s.mixer for s in cfg.layers] == CASES[case][1] and [s.ffn.kind for s in cfg.layers] == CASES[case][2]
    for spec, layer in zip(cfg.layers, hf.model.layers):
        if spec.mixer == "gdn":
            g, lin = spec.gdn, layer.linear_attn
            assert spec.attention is None and not spec.has_kv
            assert (g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim, g.conv_kernel) == (
                lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim, lin.conv_kernel_size)
            continue
        a, attn = spec.attention, layer.self_attn
        assert (a.head_dim, a.scale, a.output_gate, a.qk_norm) == (attn.head_dim, attn.scaling, True, True)
        rotary = hf.model.rotary_emb.inv_freq.shape[0] * 2
        assert int(a.head_dim * a.rope.partial_rotary_factor) == rotary < a.head_dim
    assert unserved(cfg.layers) == []


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equal_to_hf_for_40_tokens_in_fp32(case):
    check_fp32_greedy_equals_hf(*_hf(case), random_ids(21, seed=3), 40, chunk=9)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_logits_match_hf(case):
    """test_moe_vs_hf's rule on the 90th percentile of each position's max |error| against HF
    fp32: within 1.5x HF's own bf16 path plus 0.05, and at most 5% of positions further off than
    HF's bf16 path at its worst (router near-ties flip experts under bf16 rounding, in HF too)."""
    check_bf16_logits_near_hf(*_hf(case), random_ids(120))


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_greedy_matches_hf_in_bf16(seed):
    """vLLM's check_logprobs_close against HF bf16, on the mixed-dense case: on hybrid-moe HF's
    own bf16 tokens fail that check against its fp32 tokens on half the prompts (a random 4-layer
    MoE hybrid is all near-ties in bf16), so there it would test the prompt, not the code."""
    check_bf16_greedy_near_hf(*_hf("mixed-dense"), random_ids(23, seed=seed), 40, chunk=10)


def test_chunked_prefill_equals_one_prefill_and_hfs_logits():
    """Prefill chunks of 7 carry each GDN layer's conv window and state into the next chunk."""
    check_chunked_prefill(*_hf("hybrid-moe"), random_ids(75, seed=4), chunk=7, hf_tolerance=1e-3)


def test_batch_equals_each_alone_and_states_go_back():
    hf, raw = _hf("hybrid-moe")
    ids = random_ids(60)
    prompts = [ids[:21], ids[30:45], ids[5:50], ids[:3]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    alone = [ours(hf, raw, dtype=torch.float32).generate([p], params)[0][0].output_ids for p in prompts]
    engine = ours(hf, raw, dtype=torch.float32)
    assert [s.output_ids for s in engine.generate(prompts, params)[0]] == alone
    assert engine.model.free_state_slots() == 8


def test_the_gdn_projections_of_a_batch_go_through_ops_linear():
    """A GDN layer's in- and out-projections of several rows are Ops.linear's, as the attention's
    and the dense FFN's are: the cuda backend picks its 16-row kernel or cuBLAS per shape there."""
    from metrale_cli.kernels.reference import TorchOps

    class Recording(TorchOps):
        def __init__(self):
            self.calls = []  # (weight, rows)

        def linear(self, x, weight, bias=None):
            self.calls.append((weight, x.shape[0]))
            return super().linear(x, weight, bias)

    hf, raw = _hf("hybrid-moe")
    ops = Recording()
    engine = ours(hf, raw, dtype=torch.float32, ops=ops)
    ids = random_ids(40)
    engine.generate([ids[:9], ids[20:33]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    layers = [layer for layer in engine.model.layers if layer.is_ssm_layer()]
    assert len(layers) == 3
    for layer in layers:  # each prompt's prefill, then decode steps of both rows
        for weight in (layer.weights.in_proj, layer.weights.out):
            rows = [n for w, n in ops.calls if w is weight]
            assert rows[:2] == [9, 13] and set(rows[2:]) == {2}, rows


def test_more_sequences_than_state_slots_wait_and_an_exhausted_pool_is_one_error():
    from hf_oracle import planned

    from metrale_cli.engine.generate import Engine
    from metrale_cli.kernels.reference import TorchOps
    from metrale_cli.models import build_model

    hf, raw = _hf("hybrid-moe")
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    model = build_model(planned(raw), tensors, TorchOps(), 64, 512, 0, torch.device("cpu"), max_seqs=2)
    engine = Engine(model, 512)
    prompts = [random_ids(9, seed=s) for s in range(5)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    batch = [s.output_ids for s in engine.generate(prompts, params)[0]]
    assert batch == [engine.generate([p], params)[0][0].output_ids for p in prompts]
    held = [model.alloc_states(), model.alloc_states()]
    with pytest.raises(MetraleError) as info:
        model.alloc_states()
    assert info.value.message == "recurrent state pool exhausted: all 2 state slots are held by running sequences"
    assert len(held) == 2


@pytest.fixture(scope="module")
def kv_model():
    return _hf("mixed-dense")  # head_dim 64: the turbo sides need a WHT size


@pytest.fixture(scope="module")
def bf16_kv_logits(kv_model):
    return teacher_forced(ours(*kv_model, blocks=32), random_ids(50, seed=5))


@pytest.mark.parametrize("dtype", list(KvCacheDtype), ids=lambda d: d.value)
def test_every_kv_dtype_runs_with_kv_on_the_attention_layers_only(kv_model, bf16_kv_logits, dtype):
    engine = ours(*kv_model, kv=dtype, blocks=32, chunk=16)
    out = engine.generate([random_ids(30)], SamplingParams(max_new_tokens=6, ignore_eos=True))[0][0].output_ids
    assert len(out) == 6 and all(0 <= t < 384 for t in out)
    cache = engine.model.kv_cache
    assert [None if kv is None else kv.dtype for kv in cache.layers] == [dtype, None, None, None, dtype]
    assert cache.layout.kv_layers == (0, 4)
    got = teacher_forced(engine, random_ids(50, seed=5))
    assert torch.isfinite(got).all()
    nmse = ((got - bf16_kv_logits).pow(2).sum() / bf16_kv_logits.pow(2).sum()).item()
    assert nmse <= 1.0, f"{dtype.value}: {nmse:.3e}"  # sane, not a budget: test_kv_model holds those


def test_boundary_layers_count_attention_layers_only():
    _, raw = _hf("hybrid-moe", seed=1)
    raw = raw | {"num_hidden_layers": 8, "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                                                         "full_attention"] * 2}
    cfg = plan(model_config(raw), KvCacheDtype.FP8, RunnerOptions(kv_high_precision_layers="1"))
    assert [s.kv_dtype for s in cfg.layers if s.has_kv] == [KvCacheDtype.BF16, KvCacheDtype.FP8]
    cfg = plan(model_config(raw), KvCacheDtype.TURBO3, RunnerOptions())  # the dtype's minimum, of 2 KV layers
    assert [s.kv_dtype for s in cfg.layers if s.has_kv] == [KvCacheDtype.BF16, KvCacheDtype.BF16]


# --- from files, through the normal loading path ------------------------------------------------------
@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_saved_folder_generates_hf_tokens(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "qwen3_next", max_shard_size="60KB")
    llm = metrale.load(str(folder), backend="torch", dtype="fp32", max_num_seqs=2)
    prompt = llm.encode("The quick brown fox", chat=False)
    got = llm.generate("The quick brown fox", chat=False, max_new_tokens=32, ignore_eos=True).token_ids
    assert got == hf_folder_greedy(folder, prompt, 32)
    kv_line, state_line = llm.messages[0], llm.messages[1]
    assert "bytes/token over the 1 attention layers of 4" in kv_line
    per = 3 * 4 * ((2 * 32 + 32) * 4 + 4 * 16 * 8)  # 3 GDN layers: the conv's last 4 inputs + state, fp32
    assert state_line.startswith(f"recurrent state: {per} bytes/sequence") and "2 sequences at once" in state_line


def test_the_mtp_head_of_a_checkpoint_is_skipped(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_hf_checkpoint(tmp_path, "qwen3_next")
    (shard,) = folder.glob("model.safetensors")
    tensors = load_file(str(shard)) | {"mtp.fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}
    save_file(tensors, str(shard), metadata={"format": "pt"})
    llm = metrale.load(str(folder), backend="torch", dtype="fp32")
    assert len(llm.generate("fox", chat=False, max_new_tokens=3, ignore_eos=True).token_ids) == 3


BASE = {"model_type": "qwen3_next", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128, **GDN, **MOE,
        "linear_conv_kernel_dim": 4}


@pytest.mark.parametrize("change, message", [
    ({"linear_num_value_heads": 3}, "config.json linear_num_value_heads (3) is not a multiple of linear_num_key_heads (2)"),
    ({"linear_key_head_dim": None}, "config.json has no 'linear_key_head_dim'"),
    ({"linear_conv_kernel_dim": 1}, "config.json linear_conv_kernel_dim must be at least 2, got 1"),
    ({"layer_types": ["linear_attention"] * 3}, ("config.json layer_types must list 4 layer types, got "
                                                 "['linear_attention', 'linear_attention', 'linear_attention']")),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 2},
     "config.json layer_types has unknown type(s) ['sliding_attention']"),
    ({"layer_types": [["a"], "full_attention", "linear_attention", "linear_attention"]},
     "config.json layer_types has unknown type(s) [['a']]"),
    ({"full_attention_interval": 0}, "config.json key 'full_attention_interval' must be a positive integer, got 0"),
    ({"partial_rotary_factor": 0.1}, ("config.json partial_rotary_factor 0.1 rotates 3.2 of 32 dims; it must "
                                      "rotate an even number of them")),
    ({"attention_bias": True}, "config.json attention_bias=True is not supported"),
    ({"shared_expert_intermediate_size": None}, "config.json has no 'shared_expert_intermediate_size'"),
    ({"hidden_act": "gelu"}, "config.json hidden_act='gelu' is not supported"),
    ({"mlp_only_layers": [4]}, "config.json mlp_only_layers lists layer(s) [4] outside num_hidden_layers (4)"),
    ({"partial_rotary_factor": "half"}, "config.json key 'partial_rotary_factor' must be a number, got 'half'"),
    ({"rope_parameters": {"partial_rotary_factor": True}},
     "config.json key 'partial_rotary_factor' must be a number, got True"),
    ({"rms_norm_eps": [1e-6]}, "config.json key 'rms_norm_eps' must be a number, got [1e-06]"),
])
def test_a_bad_config_is_one_error_naming_the_key(change, message):
    with pytest.raises(MetraleError) as info:
        model_config({k: v for k, v in (BASE | change).items() if v is not None})
    assert info.value.message == message


def test_defaults_follow_qwen3_next_config():
    """Without layer_types, every 4th layer is full attention; without partial_rotary_factor, a
    quarter of the head rotates; without norm_topk_prob, the top-k weights are renormalized; with
    no experts, every FFN is dense."""
    cfg = model_config(BASE | {"num_hidden_layers": 8})
    assert [s.mixer for s in cfg.layers] == ["gdn", "gdn", "gdn", "attention"] * 2
    assert cfg.layers[3].attention.rope.partial_rotary_factor == 0.25
    hf_cfg = T.Qwen3NextConfig(**{k: v for k, v in BASE.items() if k != "model_type"} | {"num_hidden_layers": 8})
    assert [{"gdn": "linear_attention", "attention": "full_attention"}[s.mixer] for s in cfg.layers] == hf_cfg.layer_types
    dense = model_config(BASE | {"num_experts": 0})
    assert {s.ffn.kind for s in dense.layers} == {"swiglu"}
    assert {s.ffn.moe.norm_topk_prob for s in cfg.layers} == {hf_cfg.norm_topk_prob} == {True}


def test_a_decode_steps_roofline_counts_the_recurrent_state_it_reads():
    """bench's bytes of a decode step: the weights, each sequence's KV at the run's middle, and
    each sequence's GDN state read (the conv's K - 1 inputs and the fp32 state of every GDN layer)."""
    from metrale_cli.commands.bench import BenchOptions, _step_bytes
    from metrale_cli.engine.runner import open_runner
    from metrale_cli.engine.source import ModelSource

    hf, raw = _hf("hybrid-moe")
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    opts = RunnerOptions(backend="torch", max_seq_len=64, max_num_seqs=2, reserve_all_memory=False)
    runner = open_runner(opts, ModelSource.loaded(raw, tensors, None, "qwen3_next"))
    bench = BenchOptions(n_prompt=8, n_gen=4, batch=2)
    conv_dim = 2 * 2 * 16 + 4 * 8  # GDN: 2 key heads of 16, 4 value heads of 8
    state = 3 * 4 * (conv_dim * 3 + 4 * 16 * 8)  # 3 GDN layers, fp32
    kv = runner.model.kv_cache.layout.bytes_per_token()
    assert kv == 2 * 2 * 32 * 2  # K and V of the one attention layer (2 KV heads of 32), bf16 cache
    assert _step_bytes(runner, bench) == runner.model.weight_bytes() + 2 * ((8 + 2) * kv + state)
