"""gdn_prefill.cu emulated on the CPU: the walk over a prefill's chunks against gdn_chunked.torch_walk,
the chunked rule's inputs against the reference's preparation (gdn_reference: the key heads
repeated to the value heads, q / k L2-normalised, q scaled, the gates, zero padding), the conv
against gdn_reference.causal_conv1d over a window of the pool, and the gated norm against
gdn_reference.gated_rms_norm.

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
import torch.nn.functional as F

from host_build import build_host_library
from metrale_cli.kernels.gdn_chunked import torch_walk

_LIB: list[ctypes.CDLL] = []
CHUNK = 64


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    if not _LIB:
        handle = build_host_library("gdn_prefill_host.cpp", tmp_path_factory.mktemp("gdn_walk"))
        handle.host_gdn_chunk_walk.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 4
        handle.host_gdn_chunk_prep.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int] * 4
        handle.host_gdn_chunk_inputs.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int] * 10
        handle.host_gdn_conv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
        handle.host_gdn_gated_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5 + [ctypes.c_float]
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
    for name in ("GDN_WALK_THREADS", "GDN_WALK_COLS", "GDN_WALK_MAX_DK", "GDN_CONV_THREADS", "GDN_CONV_TOKENS",
                 "GDN_MAX_TAPS"):
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


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


@pytest.mark.parametrize("tokens, start_pos, taps, channels", [
    (1, 0, 4, 40), (2, 5, 4, 300), (3, 9, 4, 64), (70, 0, 4, 260), (130, 37, 4, 64), (5, 2, 2, 33), (9, 11, 8, 17)])
def test_the_conv_equals_the_reference_over_the_pools_window(lib, tokens, start_pos, taps, channels):
    """gdn_conv_bf16 against causal_conv1d over the K-1 entries before start_pos (position p in
    entry p % K), a token block and a channel block part-filled, fewer tokens than taps; the window
    is then the reference's, bit for bit (the last K-1 inputs at their entries)."""
    from metrale_cli.kernels import gdn_reference

    g = torch.Generator().manual_seed(tokens * 7 + taps)
    projected = torch.randn(tokens, channels + 5, generator=g).bfloat16()  # rows of a wider projection
    mixed = projected[:, :channels]
    weight = (0.5 * torch.randn(channels, taps, generator=g)).bfloat16()
    pool = torch.randn(taps, channels, generator=g).bfloat16().float()  # the slot's entries, as inputs
    want_pool = pool.clone()
    window = want_pool.roll(-((start_pos + 1) % taps), 0)[: taps - 1]
    want = gdn_reference.causal_conv1d(mixed, window, weight)
    want_pool[torch.arange(start_pos + tokens - taps + 1, start_pos + tokens) % taps] = window
    got = torch.full((tokens, channels), float("nan")).bfloat16()
    lib.host_gdn_conv(ptr(projected), ptr(weight), ptr(pool), ptr(got), tokens, start_pos, projected.shape[1],
                      channels, taps)
    assert torch.equal(pool, want_pool)
    err = (got.float() - want.float()).abs()
    assert (err <= 8e-3 * want.float().abs().clamp(min=1)).all()  # a bf16 rounding edge at most
    assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("tokens, hv, dv", [(1, 1, 16), (7, 3, 128), (65, 2, 40)])
def test_the_gated_norm_equals_the_reference(lib, tokens, hv, dv):
    """gdn_gated_norm_bf16 over the rule's (Hv, padded, Dv) fp32 output and z rows of a wider
    projection, against gated_rms_norm of the output rounded to bf16."""
    from metrale_cli.kernels import gdn_reference

    g = torch.Generator().manual_seed(tokens + dv)
    padded = -(-tokens // CHUNK) * CHUNK
    o = torch.randn(hv, padded, dv, generator=g)
    projected = torch.randn(tokens, hv * dv + 3, generator=g).bfloat16()
    z = projected[:, :hv * dv]
    norm = (1 + 0.1 * torch.randn(dv, generator=g)).bfloat16()
    got = torch.full((tokens, hv * dv), float("nan")).bfloat16()
    lib.host_gdn_gated_norm(ptr(o), ptr(projected), ptr(norm), ptr(got), tokens, padded, projected.shape[1], hv, dv,
                            1e-6)
    x = o[:, :tokens].transpose(0, 1).bfloat16().reshape(-1, dv)
    want = gdn_reference.gated_rms_norm(x, z.reshape(-1, dv), norm, 1e-6).reshape(tokens, -1)
    err = (got.float() - want.float()).abs()
    assert (err <= 8e-3 * want.float().abs().clamp(min=1)).all()
    assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("pairs, chunks, dk, dv", [(1, 1, 16, 8), (2, 3, 32, 16), (1, 2, 128, 128), (1, 1, 16, 256)])
def test_every_chunk_s_own_part_equals_the_torch_prep(lib, pairs, chunks, dk, dv):
    """gdn_chunk_prep_f32 against gdn_chunked.torch_prep: w, u, k_tail, gamma, the intra-chunk
    scores (zero above the diagonal) and q * exp(c) written over q, from inputs as
    gdn_chunk_inputs_bf16 leaves them (unit-norm k and q, g <= 0, beta in (0, 1)), a padded tail
    (g = beta = 0, q = k = 0) in the last chunk; and dv wider than dk (v staged at its own width)."""
    from metrale_cli.kernels.gdn_chunked import torch_prep

    gen = torch.Generator().manual_seed(pairs * 100 + dk + dv)
    q = F.normalize(torch.randn(pairs, chunks, CHUNK, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(pairs, chunks, CHUNK, dk, generator=gen), dim=-1)
    v = torch.randn(pairs, chunks, CHUNK, dv, generator=gen)
    g = -0.5 * torch.rand(pairs, chunks, CHUNK, generator=gen)
    beta = torch.rand(pairs, chunks, CHUNK, generator=gen)
    for x in (q, k, v, g, beta):  # the last chunk's tail is padding
        x[:, -1, CHUNK - 9:] = 0
    want = torch_prep(q, k, v, g, beta)
    got_q = q.clone()
    got = [torch.full(t.shape, float("nan")) for t in want[:5]]
    lib.host_gdn_chunk_prep(ptr(got_q), ptr(k), ptr(v), ptr(g), ptr(beta), *(ptr(t) for t in got), pairs, chunks, dk,
                            dv)
    for name, x, y in zip(("w", "u", "k_tail", "gamma", "scores", "q"), [*got, got_q], want):
        assert (x - y).abs().max() <= 1e-5 * max(1.0, y.abs().max().item()), name
    assert not got[4].triu(1).any()  # scores: nothing above the diagonal
