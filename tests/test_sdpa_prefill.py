"""sdpa_prefill (torch SDPA over the gathered paged context) against reference.paged_prefill, on
the CPU, for every KV dtype; and CudaOps' choice between it and the paged prefill kernel.

Tolerance: the "attention" row of kernels/tolerances.py (atol 2e-2, rtol 2e-2): K / V and
q·k_scale are rounded to bf16 once (relative error <= 2^-9) where the reference keeps fp32.
"""

import functools

import pytest
import torch

from metrale_cli.kernels import cuda_ops
from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.cases import compare, make_paged_case
from metrale_cli.kernels.kv_kernels import kv_kernels
from metrale_cli.kernels.sdpa_prefill import gather_context, sdpa_prefill
from metrale_cli.kernels.table import SDPA_MIN_TOKENS
from metrale_cli.kernels.tolerances import bounds
from metrale_cli.kv.dtypes import KvCacheDtype, SideType
from metrale_cli.kv.pool import LayerKv

ATTENTION_TOL = bounds("attention")

HK = 2
CASES = [(7, 0), (33, 80), (200, 37)]  # (tokens, start_pos): one block, a later chunk, a long one


@functools.lru_cache(maxsize=8)
def filled(dtype, length, head_dim):
    """A filled layer cache and a shuffled block table; shared by the GQA groups (read only)."""
    c = make_paged_case([length], HK, HK, head_dim, dtype, spare_blocks=1, seed=length + head_dim)
    return c["kv"], c["block_tables"][0]


def case(dtype, tokens, start, head_dim=64, group=4):
    g = torch.Generator().manual_seed(start)
    q = torch.randn(tokens, HK * group, head_dim, generator=g).to(torch.bfloat16)
    return (q, *filled(dtype, start + tokens, head_dim))


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens, start", CASES)
@pytest.mark.parametrize("dtype", list(KvCacheDtype), ids=lambda d: d.value)
def test_sdpa_prefill_equals_the_reference(dtype, tokens, start, group, head_dim):
    q, kv, table = case(dtype, tokens, start, head_dim, group)
    got = sdpa_prefill(q, kv, table, start, head_dim**-0.5)
    want = ref.paged_prefill(q, kv, table, start, head_dim**-0.5)
    assert got.shape == want.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert compare(got, want, *ATTENTION_TOL) is None, compare(got, want, *ATTENTION_TOL)


@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.TURBO8])
def test_heads_wider_than_256_share_kv_heads_by_repetition(dtype):
    q, kv, table = case(dtype, 33, 80, head_dim=512, group=4)
    got = sdpa_prefill(q, kv, table, 80, 512**-0.5)
    want = ref.paged_prefill(q, kv, table, 80, 512**-0.5)
    assert compare(got, want, *ATTENTION_TOL) is None, compare(got, want, *ATTENTION_TOL)


def test_the_mask_is_bottom_right_aligned():
    """Query t of a chunk at start_pos sees exactly keys 0..start_pos+t: with equal scores and a
    one-hot V per cache row, output row t is 1/(start_pos+t+1) on the rows of those positions."""
    from metrale_cli.kv.formats import new_pool

    start, tokens, d = 5, 16, 64
    kp, vp = (new_pool(SideType.BF16, 2, 1, d, torch.device("cpu")) for _ in range(2))
    vp.data.view(32, d)[:] = torch.eye(32, d).to(torch.bfloat16)  # cache row r holds e_r
    table = torch.tensor([1, 0], dtype=torch.int32)  # positions 0..15 in block 1, 16.. in block 0
    q = torch.zeros(tokens, 1, d, dtype=torch.bfloat16)
    out = sdpa_prefill(q, LayerKv(KvCacheDtype.BF16, kp, vp), table, start, 0.1)[:, 0].float()
    want = torch.zeros(tokens, d)
    for t in range(tokens):
        seen = torch.arange(start + t + 1)
        want[t, table[seen // 16].long() * 16 + seen % 16] = 1.0 / len(seen)
    assert compare(out, want, 1e-3, 1e-2) is None, compare(out, want, 1e-3, 1e-2)


@pytest.mark.parametrize("dtype", [KvCacheDtype.FP8, KvCacheDtype.FP8K_TURBO3V])
def test_fp8_scale_stays_on_the_device_side(dtype):
    """The fp8 side comes back as e4m3 values with its (1,) scale tensor, not multiplied in."""
    _, kv, table = case(dtype, 20, 0)
    kp = kv.k
    values, scale = gather_context(kp, table, 20, torch.bfloat16)
    assert scale is kp.scale
    assert torch.equal(values.float() * scale, ref.gather_context(kp, table, 20))


class RecordingLoader:
    def __init__(self):
        self.launched = []

    def launch(self, spec, sig, grid, block, *args, shared_mem=0, pdl=False):
        self.launched.append(str(spec))


@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.TURBO4K_TURBO8V])
def test_cuda_ops_runs_sdpa_from_the_threshold_up(dtype):
    attention = cuda_ops.CudaOps(RecordingLoader()).paged_attention(dtype, 64)
    n = SDPA_MIN_TOKENS
    q, kv, table = case(dtype, n, 3)
    attention.paged_prefill(q[: n - 1], kv, table, 3, 0.1)
    loader = attention.ops.loader
    assert loader.launched == [str(kv_kernels(dtype, 64).prefill[0])]
    got = attention.paged_prefill(q, kv, table, 3, 0.1)
    assert len(loader.launched) == 1  # no kernel for a chunk of SDPA_MIN_TOKENS
    assert compare(got, ref.paged_prefill(q, kv, table, 3, 0.1), *ATTENTION_TOL) is None
    attention.paged_prefill(q, kv, table, 3, 0.1, use_kernel=True)
    assert len(loader.launched) == 2
