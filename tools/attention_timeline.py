"""The batch-1 tensor-core decode attention alone, on the GPU's clock (GPU only; figures, no asserts):

    python -m tools.attention_timeline --kv-cache-dtype nvfp4 --context 32768
    python -m tools.attention_timeline --kv-cache-dtype turbo4 --context 4096 --splits 32
    python -m tools.attention_timeline --kv-cache-dtype bf16 --evict 256   # the cache out of L2

``paged_decode`` (the decode launch of the two-launch path, the output rotated back as the layer
asks for it) over a cache of random K / V, qwen3-8b's heads by default (32 on 8, head_dim 128),
built with METRALE_TIMELINE (kernels_cu/include/timeline.cuh) and launched ``--launches`` times
back to back from a CUDA graph. For the middle launches, means of:

  gap     from the launch before's last CTA to this launch's first CTA past its prologue and wait
  span    from then to this launch's last CTA's end
  marks   per CTA from its wait (median [slowest CTA]): 2 = its split decoded (output or
          partials written), 3 = the split counter taken, 4 = the combine done (the last
          split's CTA only), 5 = its end

The splits are the rule's (``decode_splits``) unless ``--splits`` sets them.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from metrale_cli.kernels import cuda_attention
from metrale_cli.kernels.cuda_ops import CudaOps
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.kv.formats import new_layer_kv
from tools import decode_timeline as tl

KIND = 2  # the standalone decode's kind in paged_decode_tc.cu's marks


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-dtype", default="nvfp4", help="any KV dtype with a tensor-core decode")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--splits", type=int, default=0, help="context splits (0: the rule's)")
    p.add_argument("--launches", type=int, default=20, help=f"launches in the graph (4 to {tl.LAUNCHES})")
    p.add_argument("--evict", type=int, default=0, metavar="MB",
                   help="between launches, write MB megabytes so the cache starts each launch out of L2 "
                        "(as in a model's step, where weights stream between layers); the gap then counts it")
    return p


def summarize(marks: np.ndarray, launches: int) -> dict:
    """Launches 1 .. launches - 2 of ``marks`` (LAUNCHES x CTAS x MARKS, ns): mean gap and span, and
    each mark's mean median and mean slowest CTA time from the CTA's start (µs; nan where no CTA
    reached it)."""
    rows = [tl._launch(marks[i]) for i in range(launches)]
    middle = range(1, launches - 1)
    return dict(
        ctas=rows[1]["ctas"],
        gap=float(np.mean([rows[i]["first"] - rows[i - 1]["end"] for i in middle])),
        span=float(np.mean([rows[i]["end"] - rows[i]["first"] for i in middle])),
        med=np.mean([rows[i]["med"] for i in middle], axis=0),
        slow=np.mean([rows[i]["slow"] for i in middle], axis=0),
    )


def random_cache(attention, dtype: KvCacheDtype, blocks: int, kv_heads: int, head_dim: int, device: torch.device):
    """A layer cache of ``blocks`` blocks, every slot written with random K and V by the dtype's
    cache write (8192 tokens a launch)."""
    kv = new_layer_kv(dtype, blocks, kv_heads, head_dim, device)
    g = torch.Generator(device=device).manual_seed(0)
    for t0 in range(0, blocks * 16, 8192):
        n = min(8192, blocks * 16 - t0)
        k, v = (torch.randn(n, kv_heads, head_dim, device=device, generator=g).to(torch.bfloat16) for _ in "kv")
        attention.reshape_and_cache(k, v, kv, torch.arange(t0, t0 + n, dtype=torch.int32, device=device))
    return kv


def captured(step, launches: int, warm=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``launches`` calls of ``step``, after one call of ``warm`` (default: ``step``)
    outside it that loads the kernels."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        (warm or step)()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(launches):
            step()
    return graph


def _cache(attention, dtype: KvCacheDtype, a, device: torch.device):
    """A one-sequence cache of ``a.context`` random keys, its block table and length."""
    blocks = (a.context + 15) // 16 + 2
    kv = random_cache(attention, dtype, blocks, a.kv_heads, a.head_dim, device)
    tables = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    return kv, tables, torch.tensor([a.context], dtype=torch.int32, device=device)


def main() -> None:
    a = parser().parse_args()
    if not 4 <= a.launches <= tl.LAUNCHES:
        raise SystemExit(f"--launches must be 4 to {tl.LAUNCHES}")
    dtype = KvCacheDtype(a.kv_cache_dtype)
    tl._timed_modules()
    ops, device = CudaOps(), torch.device("cuda")
    attention = ops.paged_attention(dtype, a.head_dim)
    if attention.tc is None:
        raise SystemExit(f"{dtype.value} has no tensor-core decode")
    kv, tables, lens = _cache(attention, dtype, a, device)
    q = torch.randn(1, a.heads, a.head_dim, device=device).to(torch.bfloat16)
    if a.splits:
        cuda_attention.decode_splits = lambda *args, **kwargs: a.splits

    def decode():
        return attention.paged_decode(q, kv, tables, lens, a.head_dim**-0.5, restore_v=True)

    scratch = torch.empty(a.evict * 10**6, dtype=torch.uint8, device=device) if a.evict else None

    def step():
        if scratch is not None:
            scratch.fill_(1)
        return decode()

    graph = captured(step, a.launches, warm=decode)
    graph.replay()
    torch.cuda.synchronize()
    marks, counts = tl._globals(ops, "paged_decode_tc")
    marks.fill(0)
    counts.fill(0)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    s = summarize(marks[KIND].get(), a.launches)
    mb = sum(p.data.numel() * p.data.element_size() for p in (kv.k, kv.v)) * a.context / (tables.shape[1] * 16) / 1e6
    print(f"{dtype.value} decode, batch 1, {a.heads} heads on {a.kv_heads} KV heads of {a.head_dim}, context "
          f"{a.context} ({mb:.1f} MB of cache data), {s['ctas']} CTAs, {a.launches} launches in a graph"
          + (f", {a.evict} MB written between them:" if a.evict else ":"))
    print(f"  gap {s['gap']:.2f} µs, span {s['span']:.2f} µs; from each CTA's start, median [slowest], µs:")
    for j, name in enumerate(("decoded", "counter", "combined", "end")):  # marks 2 .. 5
        md, sl = s["med"][j], s["slow"][j]
        print(f"    {name:9s} " + ("-" if np.isnan(md) else f"{md:6.2f} [{sl:6.2f}]"))


if __name__ == "__main__":
    main()
