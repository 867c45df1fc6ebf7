"""Gated DeltaNet decode cases shared by the host-emulation and GPU tests of gdn.cu: a mixer's
parameters and pools, the inputs of several decode steps, and the comparison of a decode op with
``gdn_reference.decode`` step after step.

Rows continue their own slots, out of slot order, at positions 0, 1, 2 and 5 (the window's
entries wrap as the steps go on); every third row from the second is padding, its slot the
scratch one, its position kept, as a decode step's padding rows are. The pools start random (a
sequence after its prefill), one ``a`` reaches softplus's linear branch (a + dt_bias > 20), and the
four inputs are views of one projection row as the layer passes them (``fused``) or tensors of
their own.
"""

from __future__ import annotations

import torch

from metrale_cli.kernels import gdn_reference
from metrale_cli.kernels.ops import GdnTensors
from metrale_cli.kernels.tolerances import bounds

def rule_inputs(tokens: int, seed: int = 0, batch: int = 2, heads: int = 4, dk: int = 16, dv: int = 8,
                device="cpu") -> list[torch.Tensor]:
    """Random inputs of the gated delta rule: q, k (B, T, H, Dk), v (B, T, H, Dv), decay g <= 0
    and beta in (0, 1) (B, T, H), a non-zero state (B, H, Dk, Dv)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, tokens, heads, dk, generator=g) for _ in range(2))
    v = torch.randn(batch, tokens, heads, dv, generator=g)
    decay = -torch.rand(batch, tokens, heads, generator=g) * 2
    beta = torch.rand(batch, tokens, heads, generator=g)
    state = 0.3 * torch.randn(batch, heads, dk, dv, generator=g)
    return [t.to(device) for t in (q, k, v, decay, beta, state)]


# (rows, key heads, value heads per key head, Dk, Dv, conv taps)
CASES = [
    (1, 1, 1, 16, 16, 4),
    (3, 2, 2, 32, 32, 4),
    (7, 3, 3, 16, 32, 2),
    (3, 4, 1, 32, 16, 4),
    (7, 1, 2, 64, 8, 4),
    (1, 2, 3, 128, 128, 4),
    (3, 1, 3, 16, 40, 2),  # Dv not a multiple of 32: idle threads in the last warp
]
START_POSITIONS = (0, 1, 2, 5)


def case_id(case) -> str:
    return "r{}-hk{}-g{}-dk{}-dv{}-k{}".format(*case)


def gdn_layer(case, seed=0, device="cpu") -> GdnTensors:
    """Random bf16 taps and norm weight, HF-like A_log (log U(1, 16)) and dt_bias, random pools of
    one slot per live row, two spare ones and the scratch one."""
    rows, hk, group, dk, dv, taps = case
    hv, channels, slots = hk * group, 2 * hk * dk + hk * group * dv, rows + 2
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale
    layer = GdnTensors(
        conv=rnd(channels, taps, scale=taps**-0.5).to(torch.bfloat16),
        a_log=(1 + 15 * torch.rand(hv, generator=g)).log(), dt_bias=rnd(hv),
        norm=(1 + rnd(dv, scale=0.1)).to(torch.bfloat16), eps=1e-6, num_k_heads=hk,
        conv_pool=rnd(slots + 1, taps, channels).to(torch.bfloat16).float(),  # inputs: bf16 values
        recurrent_pool=rnd(slots + 1, hv, dk, dv, scale=0.3))
    for name in ("conv", "a_log", "dt_bias", "norm", "conv_pool", "recurrent_pool"):
        setattr(layer, name, getattr(layer, name).to(device))
    return layer


def copy_layer(layer: GdnTensors) -> GdnTensors:
    return GdnTensors(layer.conv, layer.a_log, layer.dt_bias, layer.norm, layer.eps, layer.num_k_heads,
                      layer.conv_pool.clone(), layer.recurrent_pool.clone())


def live_rows(rows: int) -> torch.Tensor:
    return torch.tensor([r % 3 != 1 or rows == 1 for r in range(rows)])


def row_slots(rows: int, scratch: int, device="cpu") -> torch.Tensor:
    """Live rows in slots counting down from rows - 1 (out of order), padding rows in the scratch slot."""
    live = live_rows(rows)
    slots = [rows - 1 - r if live[r] else scratch for r in range(rows)]
    return torch.tensor(slots, dtype=torch.int32, device=device)


def step_inputs(layer: GdnTensors, rows: int, seed: int, fused: bool, device="cpu"):
    """mixed (rows, C), z (rows, Hv*Dv), b, a (rows, Hv) bf16; ``fused``: views of one projection."""
    hv, dv = layer.recurrent_pool.shape[1], layer.recurrent_pool.shape[3]
    sizes = [layer.conv.shape[0], hv * dv, hv, hv]
    g = torch.Generator().manual_seed(seed)
    projection = torch.randn(rows, sum(sizes), generator=g)
    projection[:, sum(sizes[:3]):] *= 2  # a: both sides of softplus' curve
    projection[0, -hv] = 24.0  # a + dt_bias > 20: softplus is its input
    projection = projection.to(torch.bfloat16).to(device)
    parts = projection.split(sizes, -1)
    return parts if fused else [p.contiguous() for p in parts]


def close(got: torch.Tensor, want: torch.Tensor, row: str = "gdn") -> None:
    atol, rtol = bounds(row)
    err = (got.double() - want.double()).abs()
    bad = err > atol + rtol * want.double().abs()
    assert not bool(bad.any()), f"{row}: {int(bad.sum())} of {bad.numel()} off, max |err| {err.max().item():.3g}"


def check_steps(decode, case, equal_share: float, steps=3, fused=True, seed=0, device="cpu") -> None:
    """``decode`` (Ops.gdn_decode's signature) and gdn_reference.decode over copies of one layer,
    ``steps`` decode steps: each step's live rows with the "gdn" row, and at least ``equal_share``
    of all those outputs bit for bit (a bf16 rounding the reference does not do, or misses, moves
    far more than sums in another order do, yet stays inside the row); then the pools of every
    slot but the scratch one (the conv inputs exactly, the state with the "gdn" row)."""
    rows = case[0]
    layer = gdn_layer(case, seed, device)
    want_layer = copy_layer(layer)
    scratch = layer.conv_pool.shape[0] - 1
    live = live_rows(rows).to(device)
    slots = row_slots(rows, scratch, device)
    starts = torch.tensor([START_POSITIONS[r % 4] for r in range(rows)], dtype=torch.int32, device=device)
    equal = total = 0
    for step in range(steps):
        positions = torch.where(live, starts + step, starts).to(torch.int32)
        inputs = step_inputs(layer, rows, seed + 1 + step, fused, device)
        got = decode(*inputs, layer, slots, positions)
        want = gdn_reference.decode(*inputs, want_layer, slots, positions)
        assert got.shape == want.shape and got.dtype == want.dtype
        close(got[live].float(), want[live].float())
        equal, total = equal + int((got[live] == want[live]).sum()), total + want[live].numel()
    assert equal >= equal_share * total, f"only {equal} of {total} outputs are the reference's bits"
    assert torch.equal(layer.conv_pool[:scratch], want_layer.conv_pool[:scratch])
    close(layer.recurrent_pool[:scratch], want_layer.recurrent_pool[:scratch])
