"""Each gemm_rows.cu variant against cuBLAS on the models' projection shapes (GPU only; figures,
no asserts):

    python -m tools.gemm_rows_shapes            # 2, 4, 8, 12 and 16 rows
    python -m tools.gemm_rows_shapes --rows 16

For every shape, eight distinct weights (so that L2 holds none of them) are chained in a CUDA graph
per variant and for ``F.linear``; the graph is replayed 15 times and the median time a projection
printed in µs, with the GB/s its weight streams at and the variant ``table.gemm_rows_variant``
picks (``cublas``: it leaves the shape to cuBLAS); for a gate/up, also cuBLAS followed by
silu_and_mul_bf16 against the SwiGLU entry. The table in docs/performance.md
(2026-12-04, 1beed15) and that rule come from this.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from metrale_cli.kernels.cuda_launch import _sm_count
from metrale_cli.kernels.cuda_ops import CudaOps
from metrale_cli.kernels.table import GEMM_ROWS, gemm_rows_variant

CHAIN = 8
# name: (n, k) of the weight
SHAPES = {
    "qwen3-8b q/k/v": (6144, 4096), "qwen3-8b o_proj": (4096, 4096), "qwen3-8b down": (4096, 12288),
    "qwen3-8b gate/up": (24576, 4096), "qwen3-4b o_proj": (2560, 4096), "qwen3-4b down": (2560, 9728),
    "qwen3-4b q/k/v": (6144, 2560), "qwen3-30b-a3b q/k/v": (5120, 2048), "qwen3-30b-a3b o_proj": (2048, 4096),
    "qwen3-0.6b q/k/v": (4096, 1024), "qwen3-0.6b o_proj": (1024, 2048), "qwen3.5-27b q/k/v": (14336, 5120),
    "qwen3.5-27b gdn in": (16384, 5120), "qwen3.5-27b o_proj": (5120, 6144), "qwen3.5-27b gate/up": (34816, 5120),
}


def _median_us(launches, reps: int = 15) -> float:
    launches()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CHAIN)
    return sorted(times)[reps // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 12, 16])
    args = parser.parse_args()
    ops, sms = CudaOps(), _sm_count(0)
    print(f"µs a projection (GB/s), {CHAIN} weights chained in a graph; {sms} SMs")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(CHAIN)]
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            times = {"cublas": _median_us(lambda: [F.linear(x, w) for w in weights])}
            for variant in GEMM_ROWS:
                times["%d/%d" % variant] = _median_us(lambda: [ops.gemm_rows(x, w, variant) for w in weights])
            if "gate/up" in name:  # with its SwiGLU: the two launches against the SwiGLU entry
                times["cublas+silu"] = _median_us(lambda: [ops.silu_and_mul(F.linear(x, w)) for w in weights])
                times["swiglu"] = _median_us(lambda: [ops.gemm_rows_swiglu(x, w) for w in weights])
            pick = gemm_rows_variant(rows, n, k, sms)
            cells = "  ".join(f"{key} {t:6.2f} ({n * k * 2 / t / 1e3:4.0f})" for key, t in times.items())
            print(f"{name:22s} {rows:2d} rows  {cells}  rule: {'cublas' if pick is None else '%d/%d' % pick}",
                  flush=True)


if __name__ == "__main__":
    main()
