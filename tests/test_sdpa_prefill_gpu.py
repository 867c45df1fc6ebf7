"""CudaOps.paged_prefill on its SDPA path (chunks of SDPA_MIN_TOKENS or more) against
reference.paged_prefill on CPU pools, for every KV dtype, on an H200.

Tolerance: the "attention" row of tests/test_kernels_gpu.py. The kernel path keeps its own test
there (test_paged_prefill, ``use_kernel=True``).
"""

import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.cases import kv_to, make_paged_case
from metrale_cli.kernels.cuda_ops import CudaOps
from metrale_cli.kernels.kv_kernels import served_head_dims
from metrale_cli.kernels.sdpa_prefill import sdpa_prefill
from metrale_cli.kernels.table import SDPA_MIN_TOKENS
from metrale_cli.kv.dtypes import KvCacheDtype
from test_kernels_gpu import close, randn

pytestmark = pytest.mark.gpu

SDPA_CASES = [(16, 0), (99, 0), (989, 37), (512, 512)]  # (tokens, start_pos)
ATTN = [(dtype, d, group) for dtype in KvCacheDtype for d in served_head_dims(dtype) if d >= 128
        for group in (1, 4, 8)]  # head_dim 512 where the dtype's kernels serve it
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


class NoKernels:
    """A loader that fails the test if CudaOps launches a kernel."""

    def launch(self, spec, *args):
        raise AssertionError(f"{spec} launched: the chunk should have run SDPA")


@pytest.fixture(scope="module")
def no_kernels():
    return CudaOps(NoKernels())


def gpu(case):
    return kv_to(case["kv"], "cuda")


@functools.lru_cache(maxsize=4)
def paged_case(dtype, length, head_dim, hk=2):
    """CPU pools filled by the reference write (read only): the GQA groups of a case share them."""
    return make_paged_case([length], hk, hk, head_dim, dtype, seed=length)


@pytest.mark.parametrize("dtype, head_dim, group", ATTN)
@pytest.mark.parametrize("tokens, start", SDPA_CASES)
def test_paged_prefill_sdpa(no_kernels, dtype, head_dim, group, tokens, start):
    assert tokens >= SDPA_MIN_TOKENS
    hk = 2
    c = paged_case(dtype, start + tokens, head_dim, hk)
    q = randn(tokens, hk * group, head_dim, seed=4, device="cpu")
    table = c["block_tables"][0]
    got = no_kernels.paged_attention(dtype, head_dim).paged_prefill(q.cuda(), gpu(c), table.cuda(), start,
                                                                    head_dim**-0.5)
    close(got, ref.paged_prefill(q, c["kv"], table, start, head_dim**-0.5), "attention")


@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.FP8, KvCacheDtype.NVFP4, KvCacheDtype.TURBO3,
                                   KvCacheDtype.FP8K_TURBO2V, KvCacheDtype.TURBO4K_TURBO8V])
@pytest.mark.parametrize("start", [0, 37])
def test_sdpa_prefill_never_waits_for_the_gpu(dtype, start):
    """No host sync in the gather, the dequantization, the mask or the dispatch."""
    c = make_paged_case([start + 99], 8, 2, 128, dtype)
    q, table, kv = randn(99, 8, 128, seed=4), c["block_tables"][0].cuda(), gpu(c)
    want = sdpa_prefill(q, kv, table, start, 128**-0.5)  # first call: decode tables reach the GPU
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sdpa_prefill(q, kv, table, start, 128**-0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    close(got, want, "attention")
    close(want, ref.paged_prefill(q.cpu(), c["kv"], c["block_tables"][0], start, 128**-0.5), "attention")


@pytest.mark.parametrize("head_dim", [128, 256, 512])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("start", [0, 37])
def test_a_fused_backend_serves_every_chunk(head_dim, group, start):
    """With torch's math backend switched off SDPA still runs: bf16 chunks at these head dims
    and GQA groups always get flash, cuDNN or memory-efficient attention."""
    hk = 2
    c = make_paged_case([start + 99], hk * group, hk, head_dim, KvCacheDtype.BF16)
    q, table = randn(99, hk * group, head_dim, seed=4), c["block_tables"][0]
    with sdpa_kernel(FUSED):
        got = sdpa_prefill(q, gpu(c), table.cuda(), start, head_dim**-0.5)
    close(got, ref.paged_prefill(q.cpu(), c["kv"], table, start, head_dim**-0.5), "attention")
