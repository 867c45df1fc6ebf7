"""HF transformers as the oracle: tiny random models and our stack built from the same weights."""

from __future__ import annotations

import contextlib

import torch
import transformers as T

from metrale_cli.config import ModelConfig
from metrale_cli.engine.generate import Engine
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.engine.sequence import Sequence
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.layers.context import ForwardContext
from metrale_cli.models import build_model, model_config

CONFIGS = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "phi3": T.Phi3Config, "qwen2": T.Qwen2Config,
           "qwen3": T.Qwen3Config, "qwen3_moe": T.Qwen3MoeConfig, "qwen2_moe": T.Qwen2MoeConfig,
           "qwen3_next": T.Qwen3NextConfig, "qwen3_5_text": T.Qwen3_5TextConfig,
           "qwen3_5_moe_text": T.Qwen3_5MoeTextConfig}
def random_ids(n: int, seed: int = 1, vocab: int = 384) -> list[int]:
    """n random token ids below ``vocab`` (TINY's), reproducible by ``seed``."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def loaded_runner(raw: dict, weights: dict, backend: str, kv: KvCacheDtype, graphs: str = "full"):
    """A runner over in-memory HF-named ``weights`` (the GPU model tests'): prefill chunks of 37
    tokens, 4 sequences, context 256, calibrations over 64 tokens, no boundary-layer promotion."""
    from metrale_cli.engine.runner import RunnerOptions, open_runner
    from metrale_cli.engine.source import ModelSource

    opts = RunnerOptions(backend=backend, kv_cache_dtype=kv, max_seq_len=256, max_num_seqs=4,
                         reserve_all_memory=False, prefill_chunk=37, fp8_kv_calibration_tokens=64,
                         cuda_graph_mode=graphs, kv_promote_minimum=False, innerq_calibration_tokens=64)
    return open_runner(opts, ModelSource.loaded(raw, dict(weights), None, raw["model_type"]))


def greedy_and_logits(runner, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after ``prompt`` and the teacher-forced logits that chose them."""
    seqs, _ = runner.engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))
    ids = seqs[0].output_ids
    return ids, teacher_forced(runner.engine, prompt + ids)[len(prompt) - 1 : -1]


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=384, max_position_embeddings=512, initializer_range=0.2)


# A family's own defaults that TINY's vocabulary cannot take (Phi-3 pads with token 32000).
FAMILY_TINY = {"phi3": dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)}


def make_hf(family: str, seed: int = 0, **overrides):
    """(HF model in fp32, its config dict). Seeded, tiny, random."""
    torch.manual_seed(seed)
    cfg = CONFIGS[family](**(TINY | FAMILY_TINY.get(family, {}) | overrides))
    return T.AutoModelForCausalLM.from_config(cfg).eval(), cfg.to_dict()


def as_dtype(hf, dtype):
    clone = T.AutoModelForCausalLM.from_config(hf.config).eval()
    clone.load_state_dict(hf.state_dict())
    return clone.to(dtype)


def planned(raw: dict, kv=KvCacheDtype.BF16) -> ModelConfig:
    """The family's config of ``raw`` with every layer's KV cache in ``kv``."""
    cfg = model_config(raw)
    return cfg.planned((kv,) * cfg.num_layers)


def ours(hf, raw: dict, kv=KvCacheDtype.BF16, dtype=torch.bfloat16, chunk=512, blocks=64,
         calibration=0, ops=None, max_batch=8) -> Engine:
    tensors = {k: v.detach().to(dtype).clone() for k, v in hf.state_dict().items()}
    model = build_model(planned(raw, kv), tensors, ops or TorchOps(), blocks, 512, calibration, torch.device("cpu"))
    return Engine(model, 512, prefill_chunk=chunk, max_batch=max_batch)


def teacher_forced(engine: Engine, ids: list[int], gather: bool = True) -> torch.Tensor:
    """Logits of every position of ``ids`` in one prefill: (len(ids), vocab) float32; the rows
    picked by index, or (``gather`` False) every row as the forward returns them all."""
    seq = Sequence(0, list(ids), 1)
    engine.model.kv_cache.ensure_capacity(seq.block_table, len(ids))
    seq.states = engine.model.alloc_states()  # released with the blocks
    n, dev = len(ids), engine.device
    ctx = ForwardContext("prefill", torch.arange(n, dtype=torch.int32, device=dev),
                         engine._int32(engine._slots(seq.block_table, range(n), 0)), 0,
                         engine._int32(seq.block_table), states=[seq.states])
    logits = engine.model.forward(torch.tensor(ids, device=dev), ctx, torch.arange(n, device=dev) if gather else None)
    engine.release(seq)
    return logits.cpu()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@contextlib.contextmanager
def hf_kv_rounded_to_bf16():
    """Make HF store K/V as our bf16 cache does (rounded to bf16), whatever its compute dtype: in its
    full-attention cache layers and in its sliding-window ones (which have an update of their own)."""
    layers = (T.cache_utils.DynamicLayer, T.cache_utils.DynamicSlidingWindowLayer)
    originals = [layer.__dict__["update"] for layer in layers]

    def rounded(original):
        def update(self, key_states, value_states, *args, **kwargs):
            rnd = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
            return original(self, rnd(key_states), rnd(value_states), *args, **kwargs)
        return update

    for layer, original in zip(layers, originals):
        layer.update = rounded(original)
    try:
        yield
    finally:
        for layer, original in zip(layers, originals):
            layer.update = original


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int):
    ids = torch.tensor([prompt])
    # an explicit mask: without one HF masks every prompt token equal to pad_token_id
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [l[0].float() for l in out.logits]


def check_logprobs_close(ours_ids, ours_logits, ref_ids, ref_logits, topk: int = 5) -> int:
    """vLLM's rule for two bf16 paths: tokens equal up to the first divergence, and there each
    side's token is in the other's top-k. Returns the length of the equal prefix."""
    for i, (a, b) in enumerate(zip(ours_ids, ref_ids)):
        if a != b:
            assert a in ref_logits[i].topk(topk).indices.tolist(), f"step {i}: ours {a} not in HF top-{topk}"
            assert b in ours_logits[i].topk(topk).indices.tolist(), f"step {i}: HF {b} not in our top-{topk}"
            return i
    return min(len(ours_ids), len(ref_ids))


def hf_folder_greedy(folder, prompt: list[int], n: int) -> list[int]:
    """HF's greedy tokens from a saved folder, in fp32 with K/V rounded to bf16 as our cache stores
    them (what our fp32 run of the same folder must equal)."""
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with hf_kv_rounded_to_bf16():
        return hf_greedy(model, prompt, n)[0]


def check_batch_decodes_as_alone(engine: Engine, prompts: list[list[int]], params) -> None:
    """Each prompt's tokens decoded in one batch equal those it gets alone, as two bf16 paths
    (cuBLAS may pick another GEMM for several rows than for one): check_logprobs_close."""
    batch = [s.output_ids for s in engine.generate(prompts, params)[0]]
    for p, got in zip(prompts, batch):
        alone = engine.generate([p], params)[0][0].output_ids
        got_logits = teacher_forced(engine, p + got)[len(p) - 1 : -1]
        alone_logits = teacher_forced(engine, p + alone)[len(p) - 1 : -1]
        check_logprobs_close(got, got_logits, alone, alone_logits)


def check_fp32_greedy_equals_hf(hf, raw: dict, prompt: list[int], n: int, chunk: int) -> None:
    """Our fp32 greedy tokens (prefill chunks of ``chunk``) equal HF's fp32 ones, ``n`` of each,
    HF's K/V rounded to bf16 as our cache stores them."""
    with hf_kv_rounded_to_bf16():
        ref_ids, _ = hf_greedy(hf, prompt, n)
    engine = ours(hf, raw, dtype=torch.float32, chunk=chunk)
    assert engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0][0].output_ids == ref_ids


def check_bf16_logits_near_hf(hf, raw: dict, ids: list[int]) -> None:
    """Our bf16 logits of ``ids`` against HF fp32, on each position's max |error|: the 90th
    percentile within 1.5x HF's own bf16 path's plus 0.05, and at most 5% of positions further off
    than HF's bf16 path at its worst (at a near-tie of a router's top-k, bf16 rounding picks other
    experts at a few positions and the logits there move by whole units; HF's bf16 path does too)."""
    ref32 = hf_logits(hf, ids)
    floor = (hf_logits(as_dtype(hf, torch.bfloat16), ids) - ref32).abs().amax(-1)
    err = (teacher_forced(ours(hf, raw), ids) - ref32).abs().amax(-1)
    q90, floor90 = err.quantile(0.9).item(), floor.quantile(0.9).item()
    assert q90 <= 1.5 * floor90 + 0.05, f"90th percentile |logit err| {q90:.3f}, HF bf16 {floor90:.3f}"
    assert (err > floor.max()).float().mean().item() <= 0.05


def check_bf16_greedy_near_hf(hf, raw: dict, prompt: list[int], n: int, chunk: int) -> None:
    """Our bf16 greedy tokens (prefill chunks of ``chunk``) against HF bf16's, ``n`` of each, by
    check_logprobs_close."""
    ref_ids, ref_logits = hf_greedy(as_dtype(hf, torch.bfloat16), prompt, n)
    engine = ours(hf, raw, chunk=chunk)
    got_ids = engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0][0].output_ids
    assert len(got_ids) == n
    got_logits = teacher_forced(engine, prompt + got_ids)[len(prompt) - 1 : -1]
    check_logprobs_close(got_ids, got_logits, ref_ids, ref_logits)


def check_chunked_prefill(hf, raw: dict, ids: list[int], chunk: int, hf_tolerance: float) -> None:
    """fp32 logits of ``ids`` prefilled in chunks of ``chunk`` equal one prefill's (a recurrent
    layer carries its state across chunks; the fp32 rounding of its chunked form differs, no more),
    and one prefill's are within ``hf_tolerance`` of HF's, K/V rounded to bf16 as ours."""
    whole = ours(hf, raw, dtype=torch.float32).teacher_forced(ids)
    chunked = ours(hf, raw, dtype=torch.float32, chunk=chunk).teacher_forced(ids)
    assert (chunked - whole).abs().max() < 1e-3
    with hf_kv_rounded_to_bf16():
        assert (whole - hf_logits(hf, ids)).abs().max() < hf_tolerance
