"""Where a batch-1 MoE layer's decode step spends its time, launch by launch (GPU only; figures,
no asserts):

    python -m tools.decode_timeline                  # Qwen3-30B-A3B's shapes, context 600
    python -m tools.decode_timeline --experts 512 --inter 512 --top-k 10 --shared 512 --layers 24 \\
        --heads 16 --kv-heads 2 --head-dim 256      # (any tools.moe_layer_launches MoE shape)
    python -m tools.decode_timeline --gdn --experts 512 --inter 512 --top-k 10 --shared 512 \\
        --layers 24                                  # Qwen3-Next's Gated DeltaNet layers

The kernels are compiled with METRALE_TIMELINE (kernels_cu/include/timeline.cuh): thread 0 of
every CTA stamps the GPU's global timer at its start, at the return of its PDL wait, at marks
inside the kernel and at its end. The layer chain of tools.moe_layer_launches (q/k/v GEMV, the
one-launch attention, o_proj, the MoE router, gate/up, down) is replayed from a CUDA graph and,
for the middle layers, each launch is split into:

  hop     from the end of the launch before (its last CTA) to this launch's first wait return
  spread  from the first wait return to the median CTA's
  marks   per CTA from its wait return to each mark (median over the CTAs, and the slowest)
  span    from the first wait return to the last CTA's end

hop + span summed over the launches is the layer. The marks: gemv 2 = the row staged (norm);
attention 2 = q staged and the new K / V written, 3 = the split's decode, 4 = the split counter
taken (none where the splits combine in a cluster); router 2 = the row staged, 3 = logits stored,
4 = the cluster barrier passed, or over more CTAs the last CTA's routing begun (it then loads the
logits until none is pending); gate/up 2 = the plan read; down (batch 1's one CTA a column tile)
2 = every slot's y in shared memory; gdn decode 2 = q and k normalised, 3 = the state updated,
4 = the gated norm's sum. With
--row-marks the build keeps three more (TL_MARKS 9): the attention's 6, 7, 8 = warp 0's first,
second and third staged row done (query heads 0 and 4, then the new key in the writing CTA); the
router's routing warp (its one CTA) 6 = every logit loaded, 7 = its lanes' keys sorted, 8 = the top
k rounds done.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from metrale_cli.kernels import registry
from metrale_cli.kernels.cuda_ops import CudaOps
from metrale_cli.kernels.loader import device_arch
from tools import moe_layer_launches

TIMED = ("gemv", "moe", "paged_decode_tc", "paged_decode_tc_wide", "gdn")
KINDS, LAUNCHES, CTAS, MARKS = 4, 64, 2048, 6
ROW_MARKS = 9  # the build with the attention's row marks (--row-marks)
# The layer's launches in order: (module, kind in timeline.cuh's numbering, name)
CHAIN = (("gemv", 0, "q/k/v gemv_norm"), ("paged_decode_tc", 0, "attention"), ("gemv", 1, "o gemv_add"),
         ("moe", 0, "moe_router"), ("moe", 1, "moe_gate_up"), ("moe", 3, "moe_down_one"))


# A Gated DeltaNet layer's (--gdn) in place of CHAIN's first three: gdn_decode_one_bf16 is gdn's kind 1
GDN_MIXER = (("gemv", 0, "in-proj gemv_norm"), ("gdn", 1, "gdn decode"), ("gemv", 1, "out-proj gemv_add"))


def chain_for(head_dim: int, gdn: bool = False) -> tuple:
    """CHAIN with the attention launch of ``head_dim``'s module (head_dim 256: paged_decode_tc_wide),
    or with a Gated DeltaNet's launches in place of the attention's."""
    if gdn:
        return GDN_MIXER + CHAIN[3:]
    attention = registry.tc_module(head_dim)
    return tuple((attention, kind, name) if module == "paged_decode_tc" else (module, kind, name)
                 for module, kind, name in CHAIN)


def _timed_modules(marks: int = MARKS) -> None:
    extra = (("TL_MARKS", str(marks)),) if marks != MARKS else ()
    for name in TIMED:
        m = registry.MODULES[name]
        registry.MODULES[name] = dataclasses.replace(m, defines=m.defines + (("METRALE_TIMELINE", "1"),) + extra)


def _globals(ops: CudaOps, name: str, marks: int = MARKS):
    """The module's timeline arrays (marks, CTA counts), or None where it was not loaded."""
    import cupy as cp

    module = registry.MODULES[name]
    raw = ops.loader._modules.get((module.name, module.defines, device_arch(0), 0))
    if raw is None:
        return None
    stamps = cp.ndarray((KINDS, LAUNCHES, CTAS, marks), dtype=cp.uint64, memptr=raw.get_global("metrale_timeline"))
    counts = cp.ndarray((KINDS,), dtype=cp.uint32, memptr=raw.get_global("metrale_timeline_ctas"))
    return stamps, counts


def _launch(m: np.ndarray) -> dict | None:
    """One launch's CTAs' marks (ns) -> its figures in µs, None where it did not run."""
    m = m[m[:, 0] > 0].astype(np.float64) / 1e3
    if not len(m):
        return None
    waited = m[:, 1]
    marks = [m[:, j] - waited for j in range(2, m.shape[1])]  # -waited where a mark was not reached
    return dict(ctas=len(m), first=waited.min(), spread=np.median(waited) - waited.min(), end=m[:, 5].max(),
                med=[np.median(x[x >= 0]) if (x >= 0).any() else np.nan for x in marks],
                slow=[x.max() if (x >= 0).any() else np.nan for x in marks])


def _replay(a) -> tuple[dict, float]:
    """The layer chain captured in a graph and replayed with the marks zeroed first: each loaded
    module's marks (ns) and the replay's µs a layer."""
    per_cta = ROW_MARKS if a.row_marks else MARKS
    _timed_modules(per_cta)
    ops = CudaOps()
    layer = moe_layer_launches.build(a, ops)["whole layer"]
    for i in range(a.layers):
        layer(i)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(a.layers):
            layer(i)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    loaded = {name: g for name in TIMED if (g := _globals(ops, name, per_cta)) is not None}
    for marks, counts in loaded.values():
        marks.fill(0)
        counts.fill(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return {name: g[0].get() for name, g in loaded.items()}, start.elapsed_time(end) * 1e3 / a.layers


def _per_layer(stamps: dict, chain: list, layers: int) -> tuple[dict, list]:
    """Each launch's figures in layers 2 .. layers - 2, with its hop from the launch before; and
    the hop from each layer's last launch into the next layer's first."""
    rows = {key: [] for key in chain}
    hops = []
    for layer in range(2, layers - 1):
        prev_end = None
        for key in chain:
            r = _launch(stamps[key[0]][key[1], layer])
            r["hop"] = r["first"] - prev_end if prev_end is not None else np.nan
            rows[key].append(r)
            prev_end = r["end"]
        hops.append(_launch(stamps[chain[0][0]][chain[0][1], layer + 1])["first"] - prev_end)
    return rows, hops


def _report(chain: list, rows: dict, hops: list, missing: list) -> None:
    print(f"  {'launch':16s} {'CTAs':>5s} {'hop':>6s} {'spread':>6s} {'span':>6s}   the marks after the wait, "
          f"median [slowest], µs")
    total = 0.0
    for key in chain:
        r = rows[key]
        hop = float(np.mean(hops if key == chain[0] else [x["hop"] for x in r]))
        span = float(np.mean([x["end"] - x["first"] for x in r]))
        total += hop + span
        med, slow = np.mean([x["med"] for x in r], axis=0), np.mean([x["slow"] for x in r], axis=0)
        marks = "  ".join("     -      " if np.isnan(md) else f"{md:5.2f} [{sl:5.2f}]" for md, sl in zip(med, slow))
        print(f"  {key[2]:16s} {r[0]['ctas']:5d} {hop:6.2f} {np.mean([x['spread'] for x in r]):6.2f} {span:6.2f}   "
              f"{marks}")
    print(f"  (the first hop is from the layer before's last launch) hops and spans: {total:.2f} µs a layer"
          + (f"; not timed: {', '.join(missing)} (no timeline marks in that launch)" if missing else ""))


def main() -> None:
    p = moe_layer_launches.parser()
    p.add_argument("--row-marks", action="store_true",
                   help="also stamp the attention's staged rows and the router's routing steps (marks 6-8; "
                        "a build with TL_MARKS 9)")
    a = p.parse_args()
    if a.dense:
        raise SystemExit("decode_timeline follows a MoE layer's launches: --dense is not served")
    stamps, us_layer = _replay(a)
    print(f"batch-1 MoE layer, hidden {a.hidden}, {moe_layer_launches.mixer_name(a)}, "
          f"{a.experts} experts of {a.inter} (top {a.top_k}), context {a.context}, {a.layers} layers"
          f"{moe_layer_launches.forced(a)}: {us_layer:.2f} µs a layer in this replay (the timeline build)")
    full = chain_for(a.head_dim, a.gdn)
    chain = [key for key in full if key[0] in stamps and _launch(stamps[key[0]][key[1], 1]) is not None]
    rows, hops = _per_layer(stamps, chain, a.layers)
    _report(chain, rows, hops, [key[2] for key in full if key not in chain])


if __name__ == "__main__":
    main()
