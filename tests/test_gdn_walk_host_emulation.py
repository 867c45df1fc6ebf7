"""gdn_prefill.cu emulated on the CPU: the walk over a prefill's chunks against gdn_chunked.torch_walk,
and the chunked rule's inputs against the reference's preparation (gdn_reference: the key heads
repeated to the value heads, q / k L2-normalised, q scaled, the gates, zero padding).

``kernels_cu/host/gdn_prefill_host.cpp`` runs the kernel over the grid the cuda backend launches:
a CTA per (sequence x head, 16 state columns), so value head widths of 8 (a part-filled tile), 16
and 24 (one full, one part-filled) and key widths of 16 and 32, over 1 and 3 chunks. The kernel
sums in index order and torch's GEMMs in theirs: equal to fp32 rounding.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from host_build import build_host_library
from metrale_cli.kernels.gdn_chunked import torch_walk

_LIB: list[ctypes.CDLL] = []
CHUNK = 64


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    if not _LIB:
        handle = build_host_library("gdn_prefill_host.cpp", tmp_path_factory.mktemp("gdn_walk"))
        handle.host_gdn_chunk_walk.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 4
        handle.host_gdn_chunk_inputs.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int] * 10
        _LIB.append(handle)
    return _LIB[0]


def _walk_inputs(pairs, chunks, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = 0.2 * torch.randn(pairs, chunks, CHUNK, dk, generator=g)
    u = torch.randn(pairs, chunks, CHUNK, dv, generator=g)
    k_tail = 0.2 * torch.randn(pairs, chunks, dk, CHUNK, generator=g)
    gamma = torch.rand(pairs, chunks, generator=g)
    state = torch.randn(pairs, dk, dv, generator=g)
    return w, u, k_tail, gamma, state


@pytest.mark.parametrize("pairs, chunks, dk, dv", [(1, 1, 16, 8), (3, 3, 32, 16), (2, 3, 16, 24)])
def test_the_walk_equals_the_torch_walk(lib, pairs, chunks, dk, dv):
    w, u, k_tail, gamma, state = _walk_inputs(pairs, chunks, dk, dv)
    want_u, want_state, want_starts = u.clone(), state.clone(), torch.empty(pairs, chunks, dk, dv)
    torch_walk(w, want_u, k_tail, gamma, want_state, want_starts)
    got_u, got_state, got_starts = u.clone(), state.clone(), torch.full((pairs, chunks, dk, dv), float("nan"))
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    lib.host_gdn_chunk_walk(ptr(w), ptr(got_u), ptr(k_tail), ptr(gamma), ptr(got_state), ptr(got_starts), pairs,
                            chunks, dk, dv)
    for got, want in ((got_u, want_u), (got_state, want_state), (got_starts, want_starts)):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max().clamp(min=1)
    assert torch.equal(got_starts[:, 0], state)  # the first chunk starts from the given state, as given


def test_the_table_mirrors_the_kernel_source():
    from metrale_cli.kernels import table
    from metrale_cli.kernels.registry import KERNELS_DIR

    source = (KERNELS_DIR / "gdn_prefill.cu").read_text()
    defines = dict(re.findall(r"^#define (\w+) (\d+)", source, re.MULTILINE))
    for name in ("GDN_WALK_THREADS", "GDN_WALK_COLS", "GDN_WALK_MAX_DK"):
        assert int(defines[name]) == getattr(table, name)
    assert int(defines["GDN_CHUNK"]) == CHUNK


@pytest.mark.parametrize("tokens, hk, hv, dk, dv", [(1, 1, 1, 16, 16), (70, 2, 6, 32, 16), (64, 2, 2, 16, 40)])
def test_the_chunk_inputs_equal_the_reference_preparation(lib, tokens, hk, hv, dk, dv):
    import torch.nn.functional as F

    from metrale_cli.kernels import gdn_reference

    g = torch.Generator().manual_seed(tokens)
    channels = 2 * hk * dk + hv * dv
    projected = torch.randn(tokens, channels + 2 * hv, generator=g).bfloat16()  # [conv out | b | a], rows of one tensor
    conv, b, a = projected.split([channels, hv, hv], -1)
    a_log, dt_bias = torch.rand(hv, generator=g).log1p(), torch.randn(hv, generator=g)
    a = a.clone()
    a[0, 0] = 30.0  # past softplus's threshold
    padded = -(-tokens // CHUNK) * CHUNK
    got = [torch.full((hv, padded, n), float("nan")) for n in (dk, dk, dv)] + [torch.full((hv, padded), float("nan"))
                                                                              for _ in range(2)]
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    stride = projected.shape[1]
    lib.host_gdn_chunk_inputs(ptr(conv), ptr(b), ptr(a), ptr(a_log), ptr(dt_bias), *(ptr(t) for t in got), tokens,
                              padded, stride, stride, a.shape[1], hk, hv, dk, dv, 32 * -(-max(dk, dv) // 32))
    q, k, v = conv.split([hk * dk, hk * dk, hv * dv], -1)
    q, k = (t.reshape(1, tokens, hk, dk).repeat_interleave(hv // hk, dim=2) for t in (q, k))
    decay = -a_log.exp() * F.softplus(a.float() + dt_bias)
    want = gdn_reference._prepare(q, k, v.reshape(1, tokens, hv, dv), decay[None], b.sigmoid()[None])
    want = [F.pad(w[0], (0, 0, 0, padded - tokens)) for w in want[:3]] + [F.pad(w[0], (0, padded - tokens))
                                                                          for w in want[3:]]
    for name, x, y in zip("qkvgb", got, want):
        assert (x - y).abs().max() <= 2e-6 * max(1.0, y.abs().max().item()), name
    assert not got[3][:, tokens:].any() and not got[4][:, tokens:].any()
