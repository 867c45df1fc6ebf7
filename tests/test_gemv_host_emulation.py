"""gemv.cu's decode GEMVs emulated on the CPU against the torch references they replace.

``kernels_cu/host/gemv_host.cpp`` runs each kernel over a grid of a few CTAs (so each warp walks
several rows, and a row several batches of loads) on odd sizes: rows 1 / 7 / 99, a row of 8
elements, rows shorter than a warp's first batch, rows whose last batch is partial, and both
prologue block sizes (k below and above 2048). The prologue must be add_rms_norm_bf16's, bit for
bit: its sum equals the reference's bytes, and the outputs are checked against fp64 products of
the row that the (emulated) unfused norm kernel writes, up to fp32 summation error and the
output's bf16 rounding.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from host_build import build_host_library
from metrale_cli.kernels import reference as ref

_LIB: list[ctypes.CDLL] = []
NORM, SWIGLU, ADD, LOGITS = 0, 1, 2, 3


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    if not _LIB:
        handle = build_host_library("gemv_host.cpp", tmp_path_factory.mktemp("gemv"))
        handle.host_gemv.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 2 + [ctypes.c_float,
                                                                                                    ctypes.c_int]
        handle.host_norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_float]
        handle.host_gemv_gate_add.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
        _LIB.append(handle)
    return _LIB[0]


def _p(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _run(lib, kind, w, x, residual, gamma, n, ctas=3, eps=1e-6):
    k = w.shape[1]
    out = torch.full((1, n), float("nan"), dtype=torch.float32 if kind == LOGITS else torch.bfloat16)
    s = torch.full_like(x, float("nan")) if residual is not None and kind != ADD else None
    lib.host_gemv(kind, _p(w), _p(x), _p(residual), _p(gamma), _p(s), _p(out), n, k, eps, ctas)
    return out, s


def _close(got, want, bound):
    """|got - want| <= bound + one bf16 ulp of want, elementwise (fp64 want)."""
    err = (got.double() - want).abs()
    assert bool((err <= bound + want.abs() * 2**-8).all()), f"max |err| {err.max().item():.3g}"


def _unfused_norm(lib, x, residual, gamma, eps=1e-6):
    """The row rms_norm_bf16 / add_rms_norm_bf16 write (emulated)."""
    out, s = torch.empty_like(x), torch.empty_like(x)
    lib.host_norm(_p(x), _p(residual), _p(gamma), _p(out), _p(s), x.shape[1], eps)
    return out


def _sum_bound(w, x):
    """fp32 summation error of each row of w·x: k·2^-24 of sum |w| |x|."""
    return (w.double().abs() @ x.double().abs()[0]) * w.shape[1] * 2**-24


@pytest.mark.parametrize("n, k", [(1, 8), (7, 200), (99, 1000), (33, 2056), (5, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_norm_equals_the_reference(lib, n, k, with_residual):
    w, x, gamma = _randn(n, k, seed=1) * 0.1, _randn(1, k, seed=2), _randn(k, seed=3)
    residual = _randn(1, k, seed=4) if with_residual else None
    got, s = _run(lib, NORM, w, x, residual, gamma, n)
    want_y, want_s = ref.gemv_norm(x, residual, gamma, 1e-6, w)
    if with_residual:
        assert torch.equal(s, want_s)
    xn = _unfused_norm(lib, x, residual, gamma)
    _close(got, xn.double() @ w.double().T, _sum_bound(w, xn))


@pytest.mark.parametrize("n, k", [(1, 8), (99, 1000), (33, 2056)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_norm_logits_are_the_bf16_outputs_widened(lib, n, k, with_residual):
    """The LM head's fp32 logits: exactly gemv_norm_bf16's outputs (and running sum), as float."""
    w, x, gamma = _randn(n, k, seed=11) * 0.1, _randn(1, k, seed=12), _randn(k, seed=13)
    residual = _randn(1, k, seed=14) if with_residual else None
    got, s = _run(lib, LOGITS, w, x, residual, gamma, n)
    want, want_s = _run(lib, NORM, w, x, residual, gamma, n)
    assert got.dtype == torch.float32 and torch.equal(got, want.float())
    if with_residual:
        assert torch.equal(s, want_s)


@pytest.mark.parametrize("inter, k", [(1, 8), (7, 200), (99, 1000), (19, 2056)])
def test_gemv_norm_swiglu_equals_the_reference(lib, inter, k):
    w, x, gamma, residual = _randn(2 * inter, k, seed=5) * 0.1, _randn(1, k, seed=6), _randn(k, seed=7), _randn(1, k, seed=8)
    got, s = _run(lib, SWIGLU, w, x, residual, gamma, inter)
    want, want_s = ref.gemv_norm_swiglu(x, residual, gamma, 1e-6, w)
    assert torch.equal(s, want_s)
    xn = _unfused_norm(lib, x, residual, gamma)
    gu = xn.double() @ w.double().T
    err = _sum_bound(w, xn) + gu.abs() * 2**-8  # then g, u, silu(g) are rounded to bf16
    g, u, eg, eu = gu[:, :inter], gu[:, inter:], err[:, :inter], err[:, inter:]
    silu_g = torch.nn.functional.silu(g)
    # silu' <= 1.1: each input's error moves the product by at most that much
    _close(got, silu_g * u, 1.1 * eg * (u.abs() + eu) + eu * silu_g.abs() + (silu_g * u).abs() * 2**-8)


@pytest.mark.parametrize("n, k", [(1, 8), (7, 200), (99, 1000), (33, 2056), (6, 3072)])
def test_gemv_add_equals_the_reference(lib, n, k):
    w, x, residual = _randn(n, k, seed=9) * 0.1, _randn(1, k, seed=10), _randn(1, n, seed=11) * 4
    got, _ = _run(lib, ADD, w, x, residual, None, n)
    y = x.double() @ w.double().T
    # the projection is rounded to bf16 before the add, the sum once more
    want = residual.double() + y
    _close(got, want, _sum_bound(w, x) + y.abs() * 2**-8)


# Gate values whose sigmoid lies far from a bf16 rounding boundary (checked below), so that the
# fp32 sigmoid of any libm rounds to the bf16 an fp64 one does.
GATES = torch.tensor([-3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])


def _gated(x, gate):
    """torch's x * sigmoid(gate) on bf16 tensors, from an fp64 sigmoid: the sigmoid rounded to bf16,
    the (exact fp32) product rounded to bf16."""
    s = (1 / (1 + torch.exp(-gate.double()))).to(torch.bfloat16)
    return (x.float() * s.float()).to(torch.bfloat16)


def _run_gated(lib, w, x, gate, residual, ctas=3):
    out = torch.full((1, w.shape[0]), float("nan"), dtype=torch.bfloat16)
    lib.host_gemv_gate_add(_p(w), _p(x), _p(gate), _p(residual), _p(out), w.shape[0], w.shape[1], ctas)
    return out


def test_gated_rows_are_torchs_bytes(lib):
    """With W the identity and no residual the output is the staged row itself: x * sigmoid(gate)
    with torch's two roundings, element for element."""
    s64 = 1 / (1 + torch.exp(-GATES.double()))
    ulp = 2.0 ** (torch.floor(torch.log2(s64)) - 7)  # a bf16 ulp at each sigmoid
    tie = torch.round(s64 / ulp - 0.5) + 0.5  # the nearest rounding boundary, in ulps
    assert bool(((s64 / ulp - tie).abs() > 1e-3).all())  # none near one: any fp32 sigmoid rounds alike
    k = 96
    x, gate = _randn(1, k, seed=30) * 3, GATES.repeat(k // len(GATES))[None].to(torch.bfloat16)
    got = _run_gated(lib, torch.eye(k, dtype=torch.bfloat16), x, gate, torch.zeros(1, k, dtype=torch.bfloat16))
    assert torch.equal(got, _gated(x, gate))


@pytest.mark.parametrize("n, k", [(1, 8), (7, 200), (99, 1000), (33, 2056)])
def test_gemv_gate_add_equals_the_reference(lib, n, k):
    w, x, residual = _randn(n, k, seed=31) * 0.1, _randn(1, k, seed=32), _randn(1, n, seed=33) * 4
    gate = GATES[torch.randint(len(GATES), (1, k), generator=torch.Generator().manual_seed(34))].to(torch.bfloat16)
    got = _run_gated(lib, w, x, gate, residual)
    xg = _gated(x, gate)
    y = xg.double() @ w.double().T
    _close(got, residual.double() + y, _sum_bound(w, xg) + y.abs() * 2**-8)

