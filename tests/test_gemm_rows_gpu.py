"""The projections of up to 16 rows (gemm_rows.cu through CudaOps.linear) on a GPU (GPU only).

Each output is the fp64 product up to fp32 summation error and the output's bf16 rounding (the
bound of test_gemv_gpu.py); a row's outputs do not depend on the rows beside it (bit for bit);
a CUDA graph's replay gives the eager bytes; CudaOps.linear runs the variant its rule picks, and
more rows, a bias, K not a multiple of 256 or a shape the rule leaves to cuBLAS go through F.linear,
unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale_cli.kernels.cuda_ops import rows_gemm_variant
from metrale_cli.kernels.table import GEMM_ROWS

pytestmark = pytest.mark.gpu

# (n, k): Qwen3-8B's q/k/v, o, gate/up, down; Qwen3.5-27B's o and down; a partial last column
# tile; one tile; the shortest K
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (5120, 6144), (5120, 17408), (1040, 4096),
          (16, 256), (48, 512)]


def _randn(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


def _close(got, x, w):
    want = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * w.shape[1] * 2**-24 + want.abs() * 2**-8
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max |err| {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("variant", list(GEMM_ROWS))
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 16])
def test_rows_projection_is_the_product(ops, n, k, rows, variant):
    x, w = _randn(rows, k, scale=2, seed=rows), _randn(n, k, scale=0.05, seed=n + k)
    got = ops.gemm_rows(x, w, variant)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    _close(got, x, w)
    alone = ops.gemm_rows(x[rows - 1 :].clone(), w, variant)
    assert torch.equal(alone[0], got[rows - 1])


@pytest.mark.parametrize("rows, n, k, variant", [(16, 4096, 4096, (2, 6)), (4, 6144, 4096, (2, 4)),
                                                 (16, 6144, 4096, (1, 4)), (16, 24576, 4096, None),
                                                 (8, 5120, 6144, None)])
def test_linear_runs_the_rules_variant(ops, rows, n, k, variant):
    x, w = _randn(rows, k, seed=12), _randn(n, k, scale=0.05, seed=13)
    assert rows_gemm_variant(x, w, None) == variant  # an H200's 132 SMs
    want = F.linear(x, w) if variant is None else ops.gemm_rows(x, w, variant)
    assert torch.equal(ops.linear(x, w), want)


@pytest.mark.parametrize("n, k", [(4096, 4096), (1040, 4096)])
def test_rows_projection_replays_from_a_graph(ops, n, k):
    x, w = _randn(16, k, seed=3), _randn(n, k, scale=0.05, seed=4)
    assert rows_gemm_variant(x, w, None) is not None
    eager = ops.linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear(x, w)
    x.copy_(_randn(16, k, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops.linear(x, w))
    x.copy_(_randn(16, k, seed=3))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_other_operands_go_through_cublas(ops):
    w, b = _randn(4096, 4096, scale=0.05, seed=6), _randn(4096, seed=7)
    for x, bias in ((_randn(17, 4096, seed=8), None), (_randn(4, 4096, seed=9), b)):
        assert rows_gemm_variant(x, w, bias) is None
        assert torch.equal(ops.linear(x, w, bias), F.linear(x, w, bias))
    x, w = _randn(4, 1000, seed=10), _randn(64, 1000, seed=11)
    assert rows_gemm_variant(x, w, None) is None
    assert torch.equal(ops.linear(x, w), F.linear(x, w))


# (2I, K): Qwen3-8B's, Qwen3-0.6B's and Qwen3.5-27B's gate/up; I = 48 (a partial grid); the shortest K
SWIGLU_SHAPES = [(24576, 4096), (6144, 1024), (34816, 5120), (96, 512), (32, 256)]


@pytest.mark.parametrize("n, k", SWIGLU_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 16])
def test_swiglu_entry_is_silu_and_mul_of_the_projection(ops, n, k, rows):
    """The bytes of silu_and_mul on the 2/4 variant's product, and within the SwiGLU tolerance of
    the fp64 product's; a row alone gives the bits it gives in the batch."""
    x, w = _randn(rows, k, scale=2, seed=rows + 20), _randn(n, k, scale=0.05, seed=n + k + 1)
    got = ops.gemm_rows_swiglu(x, w)
    assert got.shape == (rows, n // 2) and got.dtype == torch.bfloat16
    assert torch.equal(got, ops.silu_and_mul(ops.gemm_rows(x, w, (2, 4))))
    y = x.double() @ w.double().T
    want = F.silu(y[:, : n // 2]) * y[:, n // 2 :]
    assert torch.allclose(got.double(), want, rtol=2e-2, atol=2e-2)
    assert torch.equal(ops.gemm_rows_swiglu(x[rows - 1 :].clone(), w)[0], got[rows - 1])


def test_linear_silu_and_mul_runs_the_swiglu_entry_where_it_can(ops):
    x, w = _randn(16, 4096, seed=21), _randn(24576, 4096, scale=0.05, seed=22)
    assert torch.equal(ops.linear_silu_and_mul(x, w), ops.gemm_rows_swiglu(x, w))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear_silu_and_mul(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops.gemm_rows_swiglu(x, w))
    for x, w in ((_randn(17, 4096, seed=23), w), (_randn(4, 1000, seed=24), _randn(64, 1000, seed=25)),
                 (_randn(4, 512, seed=26), _randn(48, 512, seed=27))):  # 17 rows, K 1000, I = 24
        assert torch.equal(ops.linear_silu_and_mul(x, w), ops.silu_and_mul(ops.linear(x, w)))
