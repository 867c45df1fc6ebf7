"""The Gated DeltaNet mixer's ops against each other, on the CPU and (marked gpu) on an H200.

- the cuda backend's prefill rule (``gdn_chunked``: every chunk's own work batched, a walk of three
  launches a chunk) against the reference's chunked form and its token-by-token form, at the
  lengths that break chunking (1, 7, 63, 64, 65, 999), from a non-zero state;
- the cuda prefill reads nothing back from the device;
- ``gdn_reference.prefill`` and ``decode`` over a pool: a prefill, then decode steps, then another
  prefill chunk of the same sequence give what one prefill of everything gives (the conv entries
  kept by position wrap around), and a row's slot is the only one that changes.
"""

from __future__ import annotations

import pytest
import torch

from gdn_cases import rule_inputs
from metrale_cli.kernels import gdn_chunked, gdn_reference
from metrale_cli.kernels.ops import GdnTensors

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device(name)




@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 7, 63, 64, 65, 999])
def test_the_batched_chunks_equal_the_reference_forms(device, tokens):
    q, k, v, g, beta, state = rule_inputs(tokens, batch=1, heads=2 if tokens == 999 else 4, device=_device(device))
    fast, chunked, recurrent = state.clone(), state.clone(), state.clone()
    out = gdn_chunked.chunked_gated_delta_rule(q, k, v, g, beta, fast)
    want = gdn_reference.chunked_gated_delta_rule(q, k, v, g, beta, chunked)
    step = gdn_reference.recurrent_gated_delta_rule(q, k, v, g, beta, recurrent)
    assert out.shape == want.shape
    assert (out - want).abs().max() < 1e-5 and (fast - chunked).abs().max() < 1e-5
    assert (out - step).abs().max() < 2e-5 and (fast - recurrent).abs().max() < 2e-5


def _mixer(device, slots=3, hk=2, hv=4, dk=16, dv=8, taps=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    channels = 2 * hk * dk + hv * dv
    layer = GdnTensors(conv=0.5 * torch.randn(channels, taps, generator=g), a_log=torch.rand(hv, generator=g).log1p(),
                       dt_bias=torch.randn(hv, generator=g), norm=1 + 0.1 * torch.randn(dv, generator=g), eps=1e-6,
                       num_k_heads=hk, conv_pool=torch.zeros(slots + 1, taps, channels),
                       recurrent_pool=torch.zeros(slots + 1, hv, dk, dv))
    for name in ("conv", "a_log", "dt_bias", "norm", "conv_pool", "recurrent_pool"):
        setattr(layer, name, getattr(layer, name).to(device))
    return layer


def _inputs(tokens, layer, device, seed=2):
    g = torch.Generator().manual_seed(seed)
    hv, dv = layer.recurrent_pool.shape[1], layer.recurrent_pool.shape[3]
    return [torch.randn(tokens, n, generator=g).to(device) for n in (layer.conv.shape[0], hv * dv, hv, hv)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["reference", "batched"])
def test_prefill_then_decode_then_prefill_equals_one_prefill(device, rule):
    dev = _device(device)
    chunked = dict(reference=gdn_reference.chunked_gated_delta_rule, batched=gdn_chunked.chunked_gated_delta_rule)[rule]
    whole, parts = _mixer(dev), _mixer(dev)
    mixed, z, b, a = _inputs(23, whole, dev)
    want = gdn_reference.prefill(mixed, z, b, a, whole, 1, 0, rule=chunked)
    got = [gdn_reference.prefill(mixed[:9], z[:9], b[:9], a[:9], parts, 1, 0, rule=chunked)]
    slots = torch.tensor([1], dtype=torch.int32, device=dev)
    for t in range(9, 15):  # six decode steps: the window's entries wrap around
        positions = torch.tensor([t], dtype=torch.int32, device=dev)
        got.append(gdn_reference.decode(mixed[t : t + 1], z[t : t + 1], b[t : t + 1], a[t : t + 1], parts, slots,
                                        positions))
    got.append(gdn_reference.prefill(mixed[15:], z[15:], b[15:], a[15:], parts, 1, 15, rule=chunked))
    assert (torch.cat(got) - want).abs().max() < 1e-4
    assert (parts.recurrent_pool - whole.recurrent_pool).abs().max() < 1e-5
    last = torch.arange(23 - 3, 23) % 4  # the entries the next step reads
    assert torch.equal(parts.conv_pool[1, last], whole.conv_pool[1, last])
    for other in (0, 2, 3):  # no other slot was touched
        assert not parts.conv_pool[other].any() and not parts.recurrent_pool[other].any()


@pytest.mark.parametrize("device", DEVICES)
def test_decode_rows_continue_their_own_slots(device):
    """Two sequences in one decode batch, in slots 2 and 0, each equal to its own prefill."""
    dev = _device(device)
    alone, batched = _mixer(dev), _mixer(dev)
    seqs = [_inputs(6, alone, dev, seed=s) for s in (3, 4)]
    want = [gdn_reference.prefill(*x, alone, slot, 0) for x, slot in zip(seqs, (2, 0))]
    for x, slot in zip(seqs, (2, 0)):
        gdn_reference.prefill(*(t[:4] for t in x), batched, slot, 0)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=dev)
    for t in (4, 5):
        positions = torch.tensor([t, t], dtype=torch.int32, device=dev)
        rows = [torch.cat([x[i][t : t + 1] for x in seqs]) for i in range(4)]
        out = gdn_reference.decode(*rows, batched, slots, positions)
        for row, w in enumerate(want):
            assert (out[row] - w[t]).abs().max() < 1e-4
    assert (alone.recurrent_pool - batched.recurrent_pool).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 63, 64, 65, 999])
def test_the_cuda_prefill_equals_the_reference(tokens):
    """CudaOps.gdn_prefill (batched chunks, gdn_prefill.cu's walk) against gdn_reference.prefill at
    Qwen3-Next's head shape, from a state a first chunk left, in bf16."""
    from metrale_cli.kernels.cuda_ops import CudaOps

    dev = _device("cuda")
    ops = CudaOps()
    ours, want = (_mixer(dev, hk=4, hv=8, dk=128, dv=128) for _ in range(2))
    for layer in (ours, want):
        layer.conv, layer.norm = layer.conv.bfloat16(), layer.norm.bfloat16()
    first, rest = (_inputs(n, ours, dev, seed=s) for n, s in ((37, 5), (tokens, 6)))
    first, rest = ([t.bfloat16() for t in x] for x in (first, rest))
    for layer, prefill in ((ours, ops.gdn_prefill), (want, gdn_reference.prefill)):
        prefill(*first, layer, 2, 0)
    got, expected = ops.gdn_prefill(*rest, ours, 2, 37), gdn_reference.prefill(*rest, want, 2, 37)
    assert (got.float() - expected.float()).abs().max() <= 2e-2 * expected.float().abs().max()
    assert (ours.recurrent_pool - want.recurrent_pool).abs().max() < 1e-3
    assert torch.equal(ours.conv_pool, want.conv_pool)


@pytest.mark.gpu
def test_the_cuda_prefill_never_waits_for_the_gpu():
    """A prefill chunk reads nothing back from the device (a sync a layer would stall the launches
    of a long prompt): CudaOps.gdn_prefill under torch's sync check, equal to an unchecked run."""
    from metrale_cli.kernels.cuda_ops import CudaOps

    dev = _device("cuda")
    ops = CudaOps()
    layers = [_mixer(dev, hk=2, hv=4, dk=128, dv=128) for _ in range(2)]
    for layer in layers:
        layer.conv, layer.norm = layer.conv.bfloat16(), layer.norm.bfloat16()
    rest = [t.bfloat16() for t in _inputs(70, layers[0], dev, seed=7)]
    want = ops.gdn_prefill(*rest, layers[0], 1, 5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = ops.gdn_prefill(*rest, layers[1], 1, 5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want) and torch.equal(layers[0].conv_pool, layers[1].conv_pool)
