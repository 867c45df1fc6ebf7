"""Fixtures the kernel checks and tests share: comparisons (tolerance, exact bytes), paged K/V
caches filled through the reference write, and the inputs of one layer's decode-step attention.
CPU tensors, built from seeded generators; imports torch.
"""

from __future__ import annotations

import dataclasses

import torch

from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.ops import StepBuffers
from metrale_cli.kv.dtypes import KvCacheDtype, SideType, concrete
from metrale_cli.kv.formats import new_layer_kv, regions
from metrale_cli.kv.pool import LayerKv, SidePool


FP8_SCALES = (0.02, 0.03)  # K, V: x / scale spans most of e4m3's range for randn data


def compare(out: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> str | None:
    """None when |out - want| <= atol + rtol·|want| everywhere, else the worst error."""
    err = (out.float().cpu() - want.float().cpu()).abs()
    bad = err > atol + rtol * want.float().cpu().abs()
    if not bool(bad.any()):
        return None
    return f"max |err| {err.max().item():.3g} at {int(bad.sum())} of {err.numel()} elements"


def compare_bytes(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when two pools' bytes are equal, else how many differ."""
    a, b = got.cpu().contiguous().view(torch.uint8), want.cpu().contiguous().view(torch.uint8)
    diff = int((a != b).sum())
    return None if diff == 0 else f"{diff} of {a.numel()} bytes differ"


def pool_to(pool: SidePool, device) -> SidePool:
    """A copy of ``pool`` with every tensor on ``device``."""
    move = {f.name: getattr(pool, f.name) for f in dataclasses.fields(pool)}
    return SidePool(**{k: t.to(device).clone() if isinstance(t, torch.Tensor) else t for k, t in move.items()})


def kv_to(kv: LayerKv, device) -> LayerKv:
    """A copy of a layer cache with every tensor on ``device``."""
    return LayerKv(kv.dtype, pool_to(kv.k, device), pool_to(kv.v, device))


def make_paged_case(seq_lens, hq: int, hk: int, head_dim: int, dtype: KvCacheDtype | str,
                    spare_blocks: int = 3, seed: int = 0, innerq: bool = True) -> dict:
    """CPU tensors: a layer cache ``kv`` of ``dtype`` filled through the reference write with randn
    vectors, shuffled block tables, seq_lens; fp8 sides get the scales :data:`FP8_SCALES` and a
    rotated K side random InnerQ scales in [0.5, 2] when ``innerq``."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + 15) // 16 for n in seq_lens]
    width, total = max(need + [1]) + spare_blocks, sum(need) + spare_blocks
    ids = torch.randperm(total, generator=g).to(torch.int32)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = ids[at : at + n]
        at += n
    kv = new_layer_kv(concrete(dtype), total, hk, head_dim, torch.device("cpu"))
    pools = [kv.k, kv.v]
    for pool, scale in zip(pools, FP8_SCALES):
        if pool.side == SideType.FP8:
            pool.scale.fill_(scale)
    if innerq and pools[0].rotated:
        pools[0].channel_scale = 0.5 + 1.5 * torch.rand(hk, head_dim, generator=g)
    k, v = (torch.randn(total * 16, hk, head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
    ref.reshape_and_cache(k, v, kv, torch.arange(total * 16, dtype=torch.int32))
    return dict(kv=kv, block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32))


def fill_turbo8_v(case: dict, seed: int = 0, wide: int = 0) -> None:
    """Overwrite a turbo8 V side of ``case`` (make_paged_case) with every e4m3 code but NaN, at
    random, and group scales from 2^-117 (the least whose products with e4m3 are normal floats) to
    255, one in eight zero; ``wide`` random vectors get a scale of 256 or more in one group (the
    tensor-core decode takes their tiles the fp32 way, tc_turbo8_factor)."""
    pool = case["kv"].v
    assert pool.side == SideType.TURBO8, pool.side
    g = torch.Generator().manual_seed(seed)
    data, scales = regions(pool)
    codes = torch.randint(0, 254, data.shape, generator=g)
    data.copy_(codes + (codes >= 0x7F).long())  # 0x7f and 0xff, e4m3's NaNs, skipped
    bits = torch.randint(10 << 7, 135 << 7, scales[..., ::2].shape, generator=g)
    bits[torch.randint(0, 8, bits.shape, generator=g) == 0] = 0
    flat = bits.view(-1, bits.shape[-1])
    for row in torch.randperm(flat.shape[0], generator=g)[:wide]:
        flat[row, torch.randint(0, flat.shape[1], (1,), generator=g)] = torch.randint(135 << 7, 140 << 7, (1,),
                                                                                     generator=g)
    scales[..., 0::2].copy_(bits & 0xFF)
    scales[..., 1::2].copy_(bits >> 8)


def _randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def rope_decode_case(seq_lens, hq: int, hk: int, head_dim: int, dtype: KvCacheDtype | str = KvCacheDtype.BF16,
                     seed: int = 0) -> dict:
    """CPU tensors for one decode step of ``len(seq_lens)`` sequences over a ``dtype`` cache: q / k / v
    as views of a fused projection, each token at position ``seq_lens[b] - 1`` with the slot
    that position has in its block table (slot -1 where ``seq_lens[b]`` is 0), QK-norm weights,
    cos / sin tables (rot_dim = head_dim), and the paged case (:func:`make_paged_case`)."""
    c = make_paged_case(seq_lens, hq, hk, head_dim, dtype, seed=seed)
    batch, d = len(seq_lens), head_dim
    qkv = _randn(batch, (hq + 2 * hk) * d, seed=seed + 1) * 2
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    pos = torch.tensor([max(n - 1, 0) for n in seq_lens], dtype=torch.int32)
    slots = torch.tensor([int(c["block_tables"][b, (n - 1) // 16]) * 16 + (n - 1) % 16 if n else -1
                          for b, n in enumerate(seq_lens)], dtype=torch.int32)
    ang = torch.arange(max(seq_lens) + 1)[:, None] * 0.01 ** (torch.arange(d // 2) / (d // 2))
    return dict(c, q=q.view(batch, hq, d), k=k.view(batch, hk, d), v=v.view(batch, hk, d), positions=pos,
                slot_mapping=slots, cos=ang.cos(), sin=ang.sin(), q_norm=1 + _randn(d, seed=seed + 2) * 0.1,
                k_norm=1 + _randn(d, seed=seed + 3) * 0.1)


def rope_decode_args(c: dict, kv: LayerKv, device) -> tuple:
    """``PagedAttention.rope_cache_decode``'s arguments for a :func:`rope_decode_case` over ``kv``, on
    ``device``."""
    t = {n: c[n].to(device) for n in ("q", "k", "v", "slot_mapping", "positions", "cos", "sin", "q_norm", "k_norm",
                                      "block_tables", "seq_lens")}
    return (t["q"], t["k"], t["v"], kv, t["slot_mapping"], t["positions"], t["cos"], t["sin"],
            t["q_norm"], t["k_norm"], 1e-6, t["block_tables"], t["seq_lens"], c["q"].shape[2] ** -0.5)


def decode_advance_case(rows: int = 6, vocab: int = 20011, max_blocks: int = 3, seed: int = 0):
    """Logits (rows, vocab) fp32 and a :class:`StepBuffers` of ``rows + 2`` rows (two beyond the
    step: never touched) for ``Ops.decode_advance``, on the CPU. Row 0's maximum is tied three
    times (the first index must win), row 1 has a NaN, row 2 compares -0.0 with +0.0 at the top, row
    3 is not live, row 4 moves onto a new block, row 5 one block past its table."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    logits[0, [17, 9000, vocab - 1]] = 50.0
    logits[1, 12345] = float("nan")
    logits[2] = -torch.rand(vocab, generator=g) - 1.0
    logits[2, 777], logits[2, 70] = 0.0, -0.0
    step = StepBuffers.zeros(rows + 2, max_blocks, "cpu")
    step.tables.copy_(torch.randint(0, 1000, step.tables.shape, generator=g, dtype=torch.int32))
    step.positions.copy_(torch.tensor([3, 20, 40, 9, 15, 47] + [5] * (rows - 4))[: rows + 2].int())
    step.seq_lens.copy_(step.positions + 1)
    step.live.fill_(1)
    step.live[3] = 0
    step.next_tokens.copy_(torch.randint(0, vocab, (rows + 2,), generator=g))
    step.tokens.fill_(-7)
    step.slots.fill_(-9)
    return logits, step


def step_to(step, device):
    """A copy of a :class:`StepBuffers` on ``device``."""
    return StepBuffers(**{f.name: getattr(step, f.name).to(device).clone() for f in dataclasses.fields(step)})
