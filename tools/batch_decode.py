"""The tensor-core decode attention alone at a batch, streaming its cache or reading one block (GPU
only; figures, no asserts):

    python -m tools.batch_decode --kv-cache-dtype nvfp4 --kv-cache-dtype turbo4      # qwen3-8b's heads
    python -m tools.batch_decode --kv-cache-dtype nvfp4 --heads 24 --kv-heads 4 --head-dim 256  # Qwen3.5-27B's
    python -m tools.batch_decode --kv-cache-dtype turbo4k_turbo3v --batch 1 --splits 16
    python -m tools.batch_decode --kv-cache-dtype turbo4 --variant TC_CTAS_ALL=4   # A/B a build variant

``paged_decode`` (the decode launch of the two-launch path; bf16 and fp8 run the same tensor-core
decode without the fused write) over ``--batch`` sequences of ``--context`` random keys each,
replayed ``--launches`` times from a CUDA graph; the figure is µs a launch (the median of five
replays) and the cache's bytes over that time. "one block" runs the same launch with every entry of
the block tables pointing at block 0, so that the loads hit L1 / L2 and the time left is the
decode's own instructions: where the two columns are close, the cache's bytes do not bound it.

``--variant NAME=V[,NAME=V]`` (repeatable) rebuilds the decode modules with those defines and
times each dtype under every variant after the base build, in one process. ``TC_CTAS_ALL=N``
(paged_decode_tc.cu: every entry but the pair ones at N CTAs an SM) also sets the split rule's CTAs
an SM to N, as the dtype's ``TensorCoreDecode.ctas_per_sm`` would. ``TC_TURNS_ALL=1`` (``=0``) runs
every prefetching entry's tile loop with its two buffers in turns (none of them; decode_tc.cuh's
``tc_turns``). ``TC_V_SCALE_WORD=2`` (``=0``) loads a packed V side's group scales as one word a
lane in every entry that serves it (in none; decode_tc.cuh's ``tc_v_scale_word``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from metrale_cli.kernels import cuda_attention, registry
from metrale_cli.kernels.cuda_ops import CudaOps
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.kv.paged import KvLayerShape
from tools.attention_timeline import captured, random_cache
from tools.gemv_chain import replay_us
from tools.layer_variants import parse_defines, use_build


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-dtype", action="append", default=None, help="repeatable (default: nvfp4)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=32768, help="keys a sequence (a multiple of 16)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    p.add_argument("--splits", type=int, default=0, help="context splits (0: the rule's)")
    p.add_argument("--launches", type=int, default=10, help="launches in the graph")
    p.add_argument("--variant", type=parse_variant, action="append", default=[],
                   help="NAME=V[,NAME=V]: the decode modules built with these defines (repeatable)")
    return p


DECODE_MODULES = ("paged_decode_tc", "paged_decode_tc_wide")


def parse_variant(text: str) -> tuple[tuple[str, str], ...]:
    """'NAME=V,NAME=V' -> ((NAME, V), ...), for both decode modules."""
    return parse_defines(text, values=True)


def _cache(attention, dtype: KvCacheDtype, a, device: torch.device):
    """``a.batch`` sequences of ``a.context`` random keys on distinct blocks, their tables and lengths."""
    blocks = a.batch * (a.context // 16)
    kv = random_cache(attention, dtype, blocks, a.kv_heads, a.head_dim, device)
    tables = torch.arange(blocks, dtype=torch.int32, device=device).view(a.batch, a.context // 16)
    return kv, tables, torch.full((a.batch,), a.context, dtype=torch.int32, device=device)


def _launch_us(attention, q, kv, tables, lens, a) -> float:
    def decode():
        return attention.paged_decode(q, kv, tables, lens, a.head_dim**-0.5)

    graph = captured(decode, a.launches)
    return sorted(replay_us(graph, 1) for _ in range(5))[2] / a.launches


def main() -> None:
    a = parser().parse_args()
    if a.context % 16 or a.context <= 0:
        raise SystemExit("--context must be a positive multiple of 16")
    if a.splits:
        cuda_attention.decode_splits = lambda *args, **kwargs: a.splits
    ops, device = CudaOps(), torch.device("cuda")
    base = dict(registry.MODULES)
    for name in a.kv_cache_dtype or ["nvfp4"]:
        dtype = KvCacheDtype(name)
        attention = ops.paged_attention(dtype, a.head_dim)
        if attention.tc is None:
            raise SystemExit(f"{name} has no tensor-core decode at head_dim {a.head_dim}")
        kv, tables, lens = _cache(attention, dtype, a, device)
        q = torch.randn(a.batch, a.heads, a.head_dim, device=device).to(torch.bfloat16)
        chunks = math.ceil(a.heads // a.kv_heads / cuda_attention.TC_ROWS)
        nbytes = KvLayerShape(dtype, a.kv_heads, a.head_dim).bytes_per_token() * a.batch * a.context
        tc = attention.tc
        for defines in [(), *a.variant]:
            use_build(ops, base, {m: defines for m in DECODE_MODULES})
            ctas = dict(defines).get("TC_CTAS_ALL")
            attention.tc = tc if ctas is None else dataclasses.replace(tc, ctas_per_sm=int(ctas))
            splits = cuda_attention.tc_decode_splits(device, a.kv_heads * a.batch * chunks, tables.shape[1],
                                                     attention.tc)
            us = _launch_us(attention, q, kv, tables, lens, a)
            one = _launch_us(attention, q, kv, torch.zeros_like(tables), lens, a)
            label = ",".join(f"{k}={v}" for k, v in defines) or "base"
            print(f"{name:16s} {label:16s} batch {a.batch} x {a.context} keys, {a.heads} heads on {a.kv_heads} of "
                  f"{a.head_dim}, {splits} splits: {us:8.2f} µs ({nbytes / us / 1e6:.2f} TB/s of cache) | "
                  f"one block {one:8.2f} µs", flush=True)
        attention.tc = tc
        use_build(ops, base, {})
        del kv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
