"""Attention over every KV dtype on the torch backend: output error against bf16 KV within a
per-dtype NMSE budget (with the WHT bookends of the layer), prefill equal to decode, and the
per-layer plan of high-precision boundary layers."""

from __future__ import annotations

import pytest
import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.kv.dtypes import KvCacheDtype, kv_pair
from metrale_cli.kv.paged import KvLayout, PagedKvCache
from metrale_cli.kv.precision import describe, high_precision_count, layer_dtypes
from metrale_cli.kernels.rotation import restore_output, rotate_query

D = KvCacheDtype
OPS = TorchOps()

# Attention-output NMSE against exact attention over bf16 K/V (Gaussian q, k, v; 80 tokens,
# Hq 4, Hk 2, D 64). The output is a softmax-weighted mean of V, so its error is about V's
# per-element quantization NMSE; K's error perturbs the scores and adds a smaller term.
# Budgets are ~1.5-2x the measured value so a regression (wrong rotation, wrong scale) fails.
SIDE_NMSE = {"bf16": 0.0, "fp8": 1.4e-3, "turbo8": 1e-3, "nvfp4": 1.1e-2, "turbo4": 9.5e-3,
             "turbo3": 3.5e-2, "turbo2": 1.2e-1}
BUDGET = {d: 1e-4 + 2.0 * (SIDE_NMSE[kv_pair(d)[1].value] + 0.5 * SIDE_NMSE[kv_pair(d)[0].value])
          for d in KvCacheDtype}


def _nmse(a, b) -> float:
    return ((a.float() - b.float()).pow(2).sum() / b.float().pow(2).sum()).item()


def _setup(dtype: KvCacheDtype, tokens=80, hq=4, hk=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, d, generator=g).to(torch.bfloat16) for h in (hq, hk, hk))
    cache = PagedKvCache(KvLayout.uniform(1, hk, d, dtype), 8, torch.device("cpu"))
    table = [5, 2, 7, 0, 3, 1]  # scattered blocks
    slots = torch.tensor([table[t // 16] * 16 + t % 16 for t in range(tokens)], dtype=torch.int32)
    kv = cache.layers[0]
    for pool, x in ((kv.k, k), (kv.v, v)):
        if pool.side.value == "fp8":
            pool.scale.fill_(x.abs().max().float() / 448)
    OPS.paged_attention(dtype, d).reshape_and_cache(k, v, kv, slots)
    return q, k, v, kv, torch.tensor(table, dtype=torch.int32)


def _exact(q, k, v, causal: bool):
    t = q.shape[0]
    mask = torch.ones(t, t, dtype=torch.bool).tril() if causal else None
    return ref.attention(q, k.float(), v.float(), 64**-0.5, mask)


@pytest.mark.parametrize("dtype", list(KvCacheDtype), ids=lambda d: d.value)
def test_prefill_output_within_budget(dtype):
    q, k, v, kv, table = _setup(dtype)
    out = ref.paged_prefill(rotate_query(OPS, q.clone(), kv.k), kv, table, 0, 64**-0.5)
    out = restore_output(OPS, out, kv.v)
    err = _nmse(out, _exact(q, k, v, causal=True))
    assert err <= BUDGET[dtype], f"{dtype.value}: NMSE {err:.2e} > {BUDGET[dtype]:.2e}"
    if dtype == D.BF16:
        assert err < 1e-4  # only the bf16 rounding of the output


@pytest.mark.parametrize("dtype", [D.TURBO3, D.FP8K_TURBO4V, D.NVFP4, D.TURBO4K_TURBO8V])
def test_decode_equals_last_prefill_row(dtype):
    q, k, v, kv, table = _setup(dtype)
    rq = rotate_query(OPS, q.clone(), kv.k)
    prefill = ref.paged_prefill(rq, kv, table, 0, 64**-0.5)
    decode = ref.paged_decode(rq[-1:], kv, table[None], torch.tensor([80], dtype=torch.int32), 64**-0.5)
    # the same math in another fp32 summation order: at most one bf16 rounding apart
    torch.testing.assert_close(decode[0].float(), prefill[-1].float(), rtol=8e-3, atol=1e-3)


def test_rotation_matters():
    """Without the bookends a turbo cache gives garbage: the budget test is not vacuous."""
    q, k, v, kv, table = _setup(D.TURBO8)
    out = ref.paged_prefill(q, kv, table, 0, 64**-0.5)
    assert _nmse(out, _exact(q, k, v, causal=True)) > 0.3


def test_innerq_leaves_qk_unchanged():
    """K stored times s, Q divided by s: q·k is the same (fp32 q: no rounding of the query)."""
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(5, 4, 64, generator=g), torch.randn(5, 2, 64, generator=g)
    cache = PagedKvCache(KvLayout.uniform(1, 2, 64, D.TURBO8), 1, torch.device("cpu"))
    kp = cache.layers[0].k
    kp.channel_scale = torch.rand(2, 64, generator=g) * 1.5 + 0.5
    from metrale_cli.kv.formats import prepare

    k_stored = prepare(k, kp)  # rotated, times s: what the cache quantizes
    q_sent = rotate_query(OPS, q.clone(), kp)
    got = (q_sent.view(5, 2, 2, 64) * k_stored[:, :, None]).sum(-1)
    want = (q.view(5, 2, 2, 64) * k[:, :, None]).sum(-1)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(k_stored, prepare(k, cache.layers[0].v), atol=1e-2)  # s really applied


# --- high-precision boundary layers -------------------------------------------------------------
@pytest.mark.parametrize("dtype, layers, spec, bf16_head, bf16_tail", [
    (D.FP8, 30, 0, 0, 0),           # bf16 / fp8 / nvfp4: no minimum
    (D.NVFP4, 30, "auto", 1, 1),    # auto = 2
    (D.NVFP4, 5, "3", 2, 1),        # first ceil(N/2), last floor(N/2)
    (D.TURBO3, 30, 0, 5, 5),        # other turbo: max(2, ceil(30/3) = 10)
    (D.TURBO4, 4, 0, 1, 1),         # max(2, ceil(4/3) = 2)
    (D.TURBO8, 36, 0, 6, 6),        # ceil(36/3) = 12
    (D.TURBO4, 28, 20, 10, 10),     # N above the minimum wins
    (D.TURBO2, 30, 0, 12, 12),      # turbo2: max(4, ceil(4·30/5) = 24)
    (D.BF16K_TURBO3V, 10, 0, 4, 4),  # bf16k_turbo3v: max(4, 8)
    (D.TURBO2, 3, 0, 2, 1),         # capped at every layer
    (D.FP8K_TURBO2V, 6, 1, 1, 1),   # max(1, 2)
    (D.FP8, 7, "all", 4, 3),
    (D.BF16K_TURBO4V, 7, "max", 4, 3),
])
def test_high_precision_rule(dtype, layers, spec, bf16_head, bf16_tail):
    plan = layer_dtypes(dtype, layers, spec)
    n = bf16_head + bf16_tail
    expected = (D.BF16,) * bf16_head + (dtype,) * (layers - n) + (D.BF16,) * bf16_tail
    assert plan == expected
    assert high_precision_count(dtype, layers, spec) == n


def test_promotion_can_be_disabled():
    assert layer_dtypes(D.TURBO2, 30, 0, promote_minimum=False) == (D.TURBO2,) * 30
    assert describe(layer_dtypes(D.TURBO3, 6, 0)) == "bf16 layer 0, turbo3 layers 1-4, bf16 layer 5"


@pytest.mark.parametrize("spec", ["-1", "two", "1.5", "5"])  # 5 of 4 layers: more than the model has
def test_bad_high_precision_spec_is_a_user_error(spec):
    with pytest.raises(MetraleError, match="--kv-high-precision-layers"):
        layer_dtypes(D.FP8, 4, spec)
