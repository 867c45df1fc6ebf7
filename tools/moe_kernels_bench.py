"""The cuda backend's MoE experts alone, at Qwen3-30B-A3B's shapes, on a GPU (figures, no asserts).

    python tools/moe_kernels_bench.py                 # decode rows 1/4/16/64, prefill 512/4096
    python tools/moe_kernels_bench.py --experts 60 --top-k 4 --inter 1408   # Qwen1.5-MoE-A2.7B

Decode: ``CudaOps.moe`` for ``--layers`` distinct layers' random experts (so the experts a call
reads are not in L2 from the call before), replayed from one CUDA graph; the time per MoE layer,
the distinct experts it read (counted by the kernels) and their bytes over that time. Prefill: the
grouped-GEMM path against a cuBLAS GEMM per expert (one host sync for the group sizes).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.cuda_ops import CudaOps


def _decode(ops, gu, dn, rows, top_k, layers):
    experts, hidden = gu[0].shape[0], gu[0].shape[2]
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    logits = [torch.randn(rows, experts, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    read = torch.zeros(1, dtype=torch.long, device="cuda")
    for layer in range(layers):  # kernels loaded before the capture
        ops.moe(x, logits[layer], gu[layer], dn[layer], top_k, True, x, read)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            ops.moe(x, logits[layer], gu[layer], dn[layer], top_k, True, x, read)
    graph.replay()
    torch.cuda.synchronize()
    read.zero_()
    replays = 20
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / (replays * layers)
    chosen = int(read) / (replays * layers)
    expert_bytes = (gu[0][0].numel() + dn[0][0].numel()) * 2
    print(f"decode {rows:3d} rows: {seconds * 1e6:7.1f} us per MoE layer, {chosen:5.1f} experts read, "
          f"{chosen * expert_bytes / seconds / 1e9:5.0f} GB/s")


def _per_expert_gemms(ops, x, logits, gu, dn, top_k):
    tokens, hidden = x.shape
    ids, weights = ref.moe_route(logits, top_k, True)
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gu.shape[0]).tolist()
    xs, ys, start = x[order // top_k], torch.empty(tokens * top_k, hidden, device="cuda", dtype=x.dtype), 0
    for e, count in enumerate(counts):
        if count:
            ys[start:start + count] = F.linear(ops.silu_and_mul(F.linear(xs[start:start + count], gu[e])), dn[e])
            start += count
    y = torch.empty_like(ys)
    y[order] = ys
    return (y.view(tokens, top_k, hidden) * weights.to(x.dtype)[..., None]).float().sum(1).to(x.dtype)


def _prefill(ops, gu, dn, tokens, top_k):
    experts, inter2, hidden = gu.shape
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
    runs = {"grouped GEMMs": lambda: ops.moe(x, logits, gu, dn, top_k, True, None, None),
            "a GEMM per expert": lambda: _per_expert_gemms(ops, x, logits, gu, dn, top_k)}
    flops = 2 * tokens * top_k * 3 * hidden * (inter2 // 2)
    for name, run in runs.items():
        run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / 5
        print(f"prefill {tokens} tokens, {name}: {seconds * 1e3:.2f} ms per MoE layer, "
              f"{flops / seconds / 1e12:.0f} TFLOP/s over the expert GEMMs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    ops = CudaOps()
    torch.manual_seed(0)
    shape = (args.experts, 2 * args.inter, args.hidden), (args.experts, args.hidden, args.inter)
    gu = [torch.randn(*shape[0], device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
    dn = [torch.randn(*shape[1], device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
    for rows in (1, 4, 16, 64):
        _decode(ops, gu, dn, rows, args.top_k, args.layers)
    for tokens in (512, 4096):
        _prefill(ops, gu[0], dn[0], tokens, args.top_k)


if __name__ == "__main__":
    main()
