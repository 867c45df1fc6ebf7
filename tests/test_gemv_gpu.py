"""The decode GEMVs (gemv.cu) on a GPU at the shapes of Qwen3-0.6B and -8B (GPU only).

The fused prologue must be the unfused add_rms_norm_bf16 / rms_norm_bf16 bit for bit (the sum it
writes, and the row it multiplies: outputs are checked against fp64 products of the row the
unfused kernel writes, up to fp32 summation error and the output's bf16 rounding). The residual
add rounds the projection to bf16 first, as the unfused o_proj / down_proj output is.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

# (rows, k): q/k/v, o, gate/up (rows = 2I), down and the LM head of both models, and odd sizes
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (6144, 4096), (4096, 4096),
          (24576, 4096), (4096, 12288), (98, 1000), (2, 8), (77, 16384), (5120, 17408), (40, 20480)]


def _randn(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


def _close(got, want, bound):
    err = (got.double() - want).abs()
    excess = err - (bound + want.abs() * 2**-8)
    assert bool((excess <= 0).all()), f"max |err| {err.max().item():.3g}, worst excess {excess.max().item():.3g}"


def _sum_bound(w, x):
    return (w.double().abs() @ x.double().abs()[0]) * w.shape[1] * 2**-24


@pytest.mark.parametrize("rows, k", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_norm(ops, rows, k, with_residual):
    w, x, gamma = _randn(rows, k, scale=0.05), _randn(1, k, scale=3, seed=1), _randn(k, seed=2) + 1
    residual = _randn(1, k, seed=3) if with_residual else None
    got, s = ops.gemv_norm(x, residual, gamma, 1e-6, w)
    if with_residual:
        xn, want_s = ops.add_rms_norm(x, residual, gamma, 1e-6)
        assert torch.equal(s, want_s)
    else:
        xn = ops.rms_norm(x, gamma, 1e-6)
        assert s is x
    _close(got, xn.double() @ w.double().T, _sum_bound(w, xn))


@pytest.mark.parametrize("rows, k", [s for s in SHAPES if s[0] % 2 == 0])
def test_gemv_norm_swiglu(ops, rows, k):
    inter = rows // 2
    w, x, gamma, residual = _randn(rows, k, scale=0.05), _randn(1, k, seed=4), _randn(k, seed=5) + 1, _randn(1, k, seed=6)
    got, s = ops.gemv_norm_swiglu(x, residual, gamma, 1e-6, w)
    xn, want_s = ops.add_rms_norm(x, residual, gamma, 1e-6)
    assert torch.equal(s, want_s)
    # the unfused kernels from the bf16 projection on: exact but for the projection's summation order
    gu = xn.double() @ w.double().T
    err = _sum_bound(w, xn) + gu.abs() * 2**-8
    g, u, eg, eu = gu[:, :inter], gu[:, inter:], err[:, :inter], err[:, inter:]
    silu_g = torch.nn.functional.silu(g)
    _close(got, silu_g * u, 1.1 * eg * (u.abs() + eu) + eu * silu_g.abs() + (silu_g * u).abs() * 2**-8)


@pytest.mark.parametrize("rows, k", SHAPES)
def test_gemv_add(ops, rows, k):
    w, x, residual = _randn(rows, k, scale=0.05), _randn(1, k, seed=7), _randn(1, rows, scale=4, seed=8)
    got = ops.gemv_add(x, w, residual)
    y = x.double() @ w.double().T
    _close(got, residual.double() + y, _sum_bound(w, x) + y.abs() * 2**-8)


@pytest.mark.parametrize("rows, k", [(4096, 4096), (2048, 4096), (98, 1000), (2, 8)])
def test_gemv_gate_add_is_gemv_add_of_torchs_gated_row(ops, rows, k):
    """A gated attention's o_proj (Qwen3-Next's 2048 x 4096): the row times torch.sigmoid(gate),
    staged inside the GEMV, gives gemv_add's bytes on the row torch gates."""
    w, x, residual = _randn(rows, k, scale=0.05), _randn(1, k, seed=9), _randn(1, rows, scale=4, seed=10)
    gate = _randn(1, k, scale=3, seed=11)
    assert torch.equal(ops.gemv_add(x, w, residual, gate), ops.gemv_add(x * torch.sigmoid(gate), w, residual))


def test_gemv_rejects_what_it_does_not_serve(ops):
    from metrale_cli.errors import MetraleError

    w = _randn(4, 20)
    with pytest.raises(MetraleError, match="multiple of 8"):
        ops.gemv_add(_randn(1, 20), w, _randn(1, 4))
    with pytest.raises(MetraleError, match="one row"):
        ops.gemv_add(_randn(2, 24), _randn(4, 24), _randn(2, 4))


def test_programmatic_launches_chain_correctly_in_a_cuda_graph(ops):
    """Twelve dependent GEMVs launched programmatically (each may start during the last one's
    tail): replayed in a CUDA graph, every link must read its predecessor's finished output, so
    the graph's result equals the eager one bit for bit."""
    from metrale_cli.kernels.loader import _pdl_driver

    assert _pdl_driver() is not None, "cuda-bindings is needed for programmatic launches on sm_90"
    k = 4096
    ws = [_randn(k, k, scale=0.02, seed=20 + i) for i in range(4)]
    x0, g = _randn(1, k, seed=9), _randn(k, seed=10) + 1

    def chain(x):
        for i in range(12):
            y, s = ops.gemv_norm(x, None, g, 1e-6, ws[i % 4])
            x = ops.gemv_add(y, ws[(i + 1) % 4], s)
        return x

    eager = chain(x0)
    static_x = x0.clone()
    graph = torch.cuda.CUDAGraph()
    chain(static_x)  # warm the allocator outside capture
    with torch.cuda.graph(graph):
        out = chain(static_x)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
