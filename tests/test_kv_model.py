"""Every KV dtype in a whole model on the torch backend: greedy generation runs, stays close to
bf16 KV, per-layer dtypes and InnerQ calibration behave as KV_DTYPES.md says."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import make_hf, teacher_forced
from metrale_cli.engine.generate import Engine
from metrale_cli.engine.runner import RunnerOptions, check_kernels, kv_messages
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.kv import formats
from metrale_cli.kv.dtypes import kv_pair
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.kv.innerq import InnerQSettings, channel_scales
from metrale_cli.kv.paged import KvLayerShape, KvLayout
from metrale_cli.kv.precision import layer_dtypes
from metrale_cli.models import build_model, model_config

D = KvCacheDtype
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    return make_hf("qwen3", head_dim=64)  # turbo sides need a WHT size (64..512)


def _engine(tiny, dtypes=None, kv=D.BF16, innerq=InnerQSettings(), chunk=512, high_precision=0):
    hf, raw = tiny
    tensors = {k: v.detach().to(torch.bfloat16).clone() for k, v in hf.state_dict().items()}
    cfg = model_config(raw)
    cfg = cfg.planned(dtypes or layer_dtypes(kv, cfg.num_layers, high_precision))
    model = build_model(cfg, tensors, TorchOps(), 32, 512, 0, CPU, innerq=innerq)
    return Engine(model, 512, prefill_chunk=chunk)


def _ids(n, seed=5):
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", list(KvCacheDtype), ids=lambda d: d.value)
def test_greedy_generation_with_every_dtype_on_every_layer(tiny, dtype):
    engine = _engine(tiny, dtypes=(dtype,) * 3, chunk=16)
    seqs, _ = engine.generate([_ids(40)], SamplingParams(max_new_tokens=8, ignore_eos=True))
    out = seqs[0].output_ids
    assert len(out) == 8 and all(0 <= t < 384 for t in out)
    cache = engine.model.kv_cache
    k_side, v_side = kv_pair(dtype)
    assert [(kv.dtype, kv.k.side, kv.v.side) for kv in cache.layers] == [(dtype, k_side, v_side)] * 3
    assert all(p.data.view(torch.uint8).any() for p in cache.pools())  # every layer wrote its side
    assert cache.allocator.free_blocks == 32  # released


# Logit NMSE of a 3-layer random model (init 0.2, chaotic) with every layer quantized, against
# bf16 KV. Several times the attention-output budget of test_kv_attention: three layers compound.
LOGIT_NMSE = {D.FP8: 2e-2, D.TURBO8: 2e-2, D.NVFP4: 1.5e-1, D.TURBO4: 1.5e-1, D.TURBO3: 4e-1}


@pytest.mark.parametrize("dtype", list(LOGIT_NMSE), ids=lambda d: d.value)
def test_logits_close_to_bf16_kv(tiny, dtype):
    ids = _ids(60)
    want = teacher_forced(_engine(tiny), ids)
    got = teacher_forced(_engine(tiny, dtypes=(dtype,) * 3), ids)
    nmse = ((got - want).pow(2).sum() / want.pow(2).sum()).item()
    assert 0 < nmse <= LOGIT_NMSE[dtype], f"{dtype.value}: {nmse:.3e}"


def test_default_plan_keeps_boundary_layers_bf16(tiny):
    engine = _engine(tiny, kv=D.TURBO4)  # 3 layers: max(2, ceil(3/3)) = 2 boundary layers
    assert engine.model.kv_cache.layout.dtypes == (D.BF16, D.TURBO4, D.BF16)
    assert [kv.k.data.dtype for kv in engine.model.kv_cache.layers] == [torch.bfloat16, torch.uint8, torch.bfloat16]
    assert len({p.num_blocks for p in engine.model.kv_cache.pools()}) == 1


@pytest.mark.parametrize("spec", ["²", "٣", "-1", "1.5", ""])
def test_high_precision_layers_other_than_ascii_digits_are_refused(spec):
    with pytest.raises(MetraleError, match="invalid --kv-high-precision-layers"):
        layer_dtypes(D.TURBO3, 7, spec)


def test_kv_messages_report_bytes_and_layer_dtypes():
    layout = KvLayout(tuple(KvLayerShape(d, 3, 64) for d in (D.BF16,) + (D.TURBO3,) * 4 + (D.BF16,)))
    lines = kv_messages(layout, 10, 160, D.TURBO3)
    assert lines[0] == "KV cache: turbo3, 2208 bytes/token over 6 layers, 10 blocks = 160 tokens, context 160"
    assert lines[1] == ("KV layer dtypes: bf16 layer 0, turbo3 layers 1-4, bf16 layer 5 "
                        "(per layer and token: bf16 768 B, turbo3 168 B)")
    every = KvLayout.uniform(2, 3, 64, D.BF16)  # turbo3's minimum keeps both layers of a 2-layer model in bf16
    assert kv_messages(every, 10, 160, D.TURBO3) == [
        "KV cache: turbo3, 1536 bytes/token over 2 layers, 10 blocks = 160 tokens, context 160",
        "KV layer dtypes: bf16 layers 0-1 (per layer and token: bf16 768 B); no layer is turbo3: every one kept "
        "in higher precision"]


def _planned(dtype, head_dim):
    raw = {"model_type": "llama", "hidden_size": 4 * head_dim, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 100}
    cfg = model_config(raw)
    return cfg.planned((dtype,) * cfg.num_layers)


def test_turbo_needs_a_wht_head_dim():
    with pytest.raises(MetraleError, match="head_dim"):
        check_kernels(_planned(D.TURBO3, 96), "torch", CPU)
    assert check_kernels(_planned(D.TURBO3, 128), "torch", CPU) is None
    assert check_kernels(_planned(D.NVFP4, 96), "torch", CPU) is None  # nvfp4 is not rotated


@pytest.mark.parametrize("arch, loads_projections", [("sm_90", True), ("sm_89", False), ("sm_80", False)])
def test_the_start_up_check_loads_the_sm_90_projections_on_sm_90_only(monkeypatch, arch, loads_projections):
    """On an older GPU the projections of up to 16 rows run in cuBLAS, so the start-up check must
    neither load gemm_rows.cu's kernels (they do not compile there) nor refuse to start for them."""
    from metrale_cli.kernels import loader as loader_mod
    from metrale_cli.kernels.table import SM90_KERNELS

    asked = []

    class Loader:
        def function(self, spec, device):
            asked.append(spec)
            if spec in SM90_KERNELS and arch != "sm_90":
                raise MetraleError("does not compile for " + arch)

    monkeypatch.setattr(loader_mod, "KernelLoader", Loader)
    monkeypatch.setattr(loader_mod, "device_arch", lambda index: arch)
    monkeypatch.setattr(loader_mod, "device_index", lambda device: 0)
    assert isinstance(check_kernels(_planned(D.BF16, 128), "cuda", torch.device("cuda", 0)), Loader)
    assert any(s in SM90_KERNELS for s in asked) == loads_projections
    assert len(asked) > 10  # the rest of the layer's kernels are still loaded


# --- InnerQ -----------------------------------------------------------------------------------
def test_channel_scales_rule():
    flat = torch.ones(2, 64)
    assert channel_scales(flat * 7.0, 7, 0.5) is None  # every ratio is 1
    sumsq = torch.ones(1, 64)
    sumsq[0, 0] = 16.0  # rms 4 on channel 0
    s = channel_scales(sumsq, 1, 0.5)
    mean = (4 + 63) / 64
    assert s[0, 0].item() == pytest.approx((mean / 4) ** 0.5)
    assert s[0, 1].item() == pytest.approx(mean ** 0.5)
    sumsq[0, 1] = 1e6  # huge channel: clamped at 0.5
    assert channel_scales(sumsq, 1, 1.0)[0, 1].item() == 0.5


def _skewed(tiny):
    """K with a few dominant channels after rotation is what InnerQ is for: scale one K row."""
    hf, raw = tiny
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.k_norm.weight[:8] *= 6.0
    return hf, raw


def test_innerq_requantizes_positions_written_before_the_freeze():
    """Chunks of 16 tokens, calibration over 40: positions 0-31 are written with s = 1, then
    re-quantized at the freeze; every position then reads back near R·k·s (within turbo4's
    per-element error, twice for the re-quantized ones), never near R·k."""
    from metrale_cli.kv.innerq import InnerQPolicy
    from metrale_cli.kv.paged import PagedKvCache

    from metrale_cli.kv.wht import rotate_fp32

    cache = PagedKvCache(KvLayout.uniform(1, 2, 64, D.TURBO4), 4, CPU)
    g = torch.Generator().manual_seed(6)
    uneven = torch.randn(48, 2, 64, generator=g) * torch.linspace(0.2, 3.0, 64)  # in the rotated basis
    k = rotate_fp32(uneven, cache.layers[0].k.signs, inverse=True).to(torch.bfloat16)
    policy = InnerQPolicy(cache, InnerQSettings(tokens=40))
    pool = cache.layers[0].k
    for start in range(0, 48, 16):
        slots = torch.arange(start, start + 16, dtype=torch.int32)
        policy.observe(0, k[start : start + 16], slots)
        formats.store(k[start : start + 16], pool, slots)
    assert policy.frozen == [True] and pool.channel_scale is not None
    back = formats.load(pool, torch.arange(4, dtype=torch.int32), 48)
    scaled = formats.prepare(k, pool)

    def nmse(a, b):
        return ((a - b).pow(2).sum() / b.pow(2).sum()).item()

    requantized = nmse(back[:32], scaled[:32])
    assert requantized < 2.5e-2 and nmse(back[32:], scaled[32:]) < 1.5e-2
    pool.channel_scale = None
    unscaled = formats.prepare(k, pool)
    assert nmse(back[:32], unscaled[:32]) > 3 * requantized


def test_innerq_in_a_model_keeps_logits_near_bf16_kv(tiny):
    hf, raw = _skewed(make_hf("qwen3", head_dim=64))
    ids = _ids(48)
    want = teacher_forced(_engine((hf, raw)), ids)
    plain = teacher_forced(_engine((hf, raw), dtypes=(D.TURBO4,) * 3, chunk=16), ids)
    calibrated = _engine((hf, raw), dtypes=(D.TURBO4,) * 3, chunk=16, innerq=InnerQSettings(tokens=40))
    policy = calibrated.model.calibration.innerq
    assert policy.describe().startswith("InnerQ: calibrating K channel scales over the first 40 tokens")
    calibrated.generate([ids], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert all(policy.frozen) and calibrated.model.kv_frozen
    assert policy.outcome() == ("InnerQ: scales applied on 3 layer(s), skipped on 0 "
                                "(every channel within 1.2x of the mean)")
    got = teacher_forced(calibrated, ids)

    def nmse(a):
        return ((a - want).pow(2).sum() / want.pow(2).sum()).item()

    # QKᵀ is unchanged by InnerQ; only the quantization error moves, so it stays turbo4-sized
    assert nmse(got) < 1.5 * nmse(plain) + 1e-2


def test_an_innerq_calibration_longer_than_the_run_is_said_to_be_unfinished(tiny):
    engine = _engine(tiny, kv=D.TURBO4, innerq=InnerQSettings(tokens=64))
    policy = engine.model.calibration.innerq
    engine.generate([_ids(20)], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert policy.layers and not any(policy.frozen[i] for i in policy.layers) and not engine.model.kv_frozen
    assert policy.outcome() == ("InnerQ: not calibrated: the cache took 24 of the 64 tokens the calibration "
                                "reads, so no scales apply yet (a smaller --innerq-calibration-tokens or a "
                                "longer run)")


def test_an_innerq_strength_without_calibration_tokens_is_said_to_do_nothing(tiny):
    engine = _engine(tiny, kv=D.TURBO4, innerq=InnerQSettings(tokens=0, strength=0.7))
    assert engine.model.calibration.innerq.describe() == (
        "InnerQ: off, so strength 0.7 (TURBO_INNERQ_STRENGTH) has no effect: it needs "
        "--innerq-calibration-tokens N or TURBO_INNERQ=N")
    assert _engine(tiny, kv=D.TURBO4).model.calibration.innerq.describe() is None


def test_innerq_is_off_without_a_rotated_k_side(tiny):
    engine = _engine(tiny, kv=D.BF16K_TURBO4V, innerq=InnerQSettings(tokens=16))
    assert engine.model.calibration.innerq.describe().startswith("InnerQ: off")
    assert all(engine.model.calibration.innerq.frozen)


def _fp8_model(tiny, scale):
    hf, raw = tiny
    tensors = {k: v.detach().to(torch.bfloat16).clone() for k, v in hf.state_dict().items()}
    cfg = model_config(raw)
    for i in range(cfg.num_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(scale)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(scale)
    cfg = cfg.planned(layer_dtypes(D.FP8, cfg.num_layers))
    return build_model(cfg, tensors, TorchOps(), 32, 512, 16, CPU)


def test_fp8_calibration_line_says_what_it_calibrates_over(tiny):
    """The scales come from each layer's first write (a short prompt: fewer than N tokens), not N tokens."""
    hf, raw = tiny
    tensors = {k: v.detach().to(torch.bfloat16).clone() for k, v in hf.state_dict().items()}
    cfg = model_config(raw)
    model = build_model(cfg.planned(layer_dtypes(D.FP8, cfg.num_layers)), tensors, TorchOps(), 32, 512, 256, CPU)
    assert model.calibration.describe() == [
        "fp8 KV scales: online calibration over each layer's first write, at most 256 tokens (amax/448, then frozen)"]


def test_fp8_scales_from_the_checkpoint(tiny):
    model = _fp8_model(tiny, 0.05)
    assert model.calibration.describe() == ["fp8 KV scales: from the checkpoint"]
    assert model.kv_cache.layers[0].k.scale.item() == pytest.approx(0.05)


@pytest.mark.parametrize("scale", [0.0, -0.05, float("nan"), float("inf"), [0.05, 0.05]])
def test_a_checkpoint_fp8_scale_that_is_not_one_positive_number_is_refused(tiny, scale):
    with pytest.raises(MetraleError, match="fp8 KV scale model.layers.0.self_attn.k_scale .* one finite positive"):
        _fp8_model(tiny, scale)


def test_innerq_env_levers(monkeypatch):
    monkeypatch.setenv("TURBO_INNERQ", "64")
    monkeypatch.setenv("TURBO_INNERQ_STRENGTH", "0.25")
    assert RunnerOptions().innerq() == InnerQSettings(64, 0.25)
    assert RunnerOptions(innerq_calibration_tokens=0).innerq() == InnerQSettings(0, 0.25)  # the flag wins
    monkeypatch.setenv("TURBO_INNERQ", "many")
    with pytest.raises(MetraleError, match="TURBO_INNERQ"):
        RunnerOptions().innerq()


@pytest.mark.parametrize("strength", ["nan", "inf", "-inf"])
def test_innerq_strength_must_be_finite(monkeypatch, strength):
    monkeypatch.setenv("TURBO_INNERQ", "64")
    monkeypatch.setenv("TURBO_INNERQ_STRENGTH", strength)
    with pytest.raises(MetraleError, match=f"TURBO_INNERQ_STRENGTH='{strength}' is not a finite number"):
        RunnerOptions().innerq()
