"""The cuda backend against the torch references for every KV dtype, on an H200: cache bytes
equal bit for bit (docs/kv-formats.md), attention within the NMSE budgets of
test_kv_attention.py, WHT bookends in bf16 equal, and greedy generation of a model equal."""

from __future__ import annotations

import pytest
import torch

from metrale_cli.kernels import reference as ref_attn
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.kv.paged import KvLayout, PagedKvCache
from metrale_cli.kv.wht import wht_signs
from metrale_cli.kernels.rotation import restore_output, rotate_query

pytestmark = pytest.mark.gpu
REF = TorchOps()


def _caches(dtype, hk, d, blocks=6):
    """Two one-layer caches of ``dtype`` on the GPU: their LayerKv."""
    dev = torch.device("cuda")
    return [PagedKvCache(KvLayout.uniform(1, hk, d, dtype), blocks, dev).layers[0] for _ in range(2)]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(KvCacheDtype), ids=lambda d: d.value)
def test_cache_bytes_equal_the_reference(ops, dtype, d):
    hk, tokens = 2, 37
    g = torch.Generator(device="cuda").manual_seed(d)
    k = torch.randn(tokens, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(tokens, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(6 * 16, device="cuda", generator=g)[:tokens].to(torch.int32)
    slots[3] = -1
    mine, ref = _caches(dtype, hk, d)
    for kv in (mine, ref):
        for pool in (kv.k, kv.v):
            pool.scale.fill_(0.011)
    ops.paged_attention(dtype, d).reshape_and_cache(k, v, mine, slots)
    ref_attn.reshape_and_cache(k, v, ref, slots)
    for a, b in ((mine.k, ref.k), (mine.v, ref.v)):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), f"{dtype.value} {a.side.value}"


@pytest.mark.parametrize("dtype", list(KvCacheDtype), ids=lambda d: d.value)
def test_attention_equals_the_reference(ops, dtype):
    hq, hk, d, tokens = 8, 2, 128, 70
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(tokens, h, d, device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hk, hk))
    kv = _caches(dtype, hk, d)[0]
    kp, vp = kv.k, kv.v
    attention = ops.paged_attention(dtype, d)
    table = torch.tensor([4, 1, 5, 0, 2], dtype=torch.int32, device="cuda")
    slots = torch.tensor([int(table[t // 16]) * 16 + t % 16 for t in range(tokens)], dtype=torch.int32,
                         device="cuda")
    ref_attn.reshape_and_cache(k, v, kv, slots)
    rq = rotate_query(REF, q.clone(), kp)
    want = restore_output(REF, ref_attn.paged_prefill(rq, kv, table, 0, d**-0.5), vp)
    got = restore_output(ops, attention.paged_prefill(rotate_query(ops, q.clone(), kp), kv, table, 0, d**-0.5), vp)
    nmse = ((got.float() - want.float()).pow(2).sum() / want.float().pow(2).sum()).item()
    assert nmse < 1e-4, f"{dtype.value} prefill: {nmse:.2e}"  # same stored values; fp32 order and bf16 only
    lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    dec = attention.paged_decode(rq[-1:].contiguous(), kv, table[None], lens, d**-0.5)
    ref_dec = ref_attn.paged_decode(rq[-1:], kv, table[None], lens, d**-0.5)
    nmse = ((dec.float() - ref_dec.float()).pow(2).sum() / ref_dec.float().pow(2).sum()).item()
    assert nmse < 1e-4, f"{dtype.value} decode: {nmse:.2e}"


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_wht_bf16_equals_the_reference(ops, d):
    x = torch.randn(33, d, device="cuda").to(torch.bfloat16)
    signs = wht_signs(d, "cuda")
    for inverse in (False, True):
        assert torch.equal(ops.wht(x.clone(), signs, inverse), REF.wht(x.clone(), signs, inverse))
