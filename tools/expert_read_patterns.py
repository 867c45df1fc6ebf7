"""How fast batch 1's MoE gate/up weight reads stream in four layouts, as pure loads (GPU only).

    python -m tools.expert_read_patterns        # Qwen3-30B-A3B's 8 chosen experts of 768 x 2048

Each launch reads ``--experts`` experts' gate and up rows (50.3 MB at the default shape) with
moe_gate_up_one_bf16's grid, warps and register ring but no MMAs (tools/expert_read_patterns.cu
names the layouts). ``--layers`` launches on distinct buffers (beyond L2) are replayed four times
from a CUDA graph. Each pattern runs twice: with 72 KB of dynamic shared memory a CTA (three CTAs
an SM, as moe_gate_up_one_bf16's registers allow, but a small L1), and without (the grid's 384
CTAs fall about three an SM anyway, with the whole L1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

SOURCE = Path(__file__).with_name("expert_read_patterns.cu")
KERNELS = ("rows2", "rows3", "rowsw2", "rowsw3", "tiled2", "tiled3", "run2", "run3")
SMALL_L1 = 72 * 1024


def main() -> None:
    import cupy as cp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    a = parser.parse_args()
    module = cp.RawModule(code=SOURCE.read_text(), options=("-std=c++17", "-arch=sm_90"), backend="nvrtc")
    nbytes = a.experts * 2 * a.inter * a.hidden * 2
    buffers = [cp.random.randint(0, 255, nbytes, dtype=cp.uint8) for _ in range(a.layers)]
    sink = cp.zeros(4, dtype=cp.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    grid = (a.inter // 16, a.experts)
    print(f"{a.experts} experts x {2 * a.inter} rows x {a.hidden}: {nbytes / 1e6:.1f} MB a launch, grid {grid}")
    for shared in (SMALL_L1, 0):
        for name in KERNELS:
            fn = module.get_function(name)
            fn.max_dynamic_shared_size_bytes = SMALL_L1

            def chain():
                for buf in buffers:
                    fn(grid, (128,), (buf, cp.int32(a.hidden), cp.int32(a.inter), sink), shared_mem=shared)

            with stream:
                chain()
                stream.synchronize()
                stream.begin_capture()
                for _ in range(4):
                    chain()
                graph = stream.end_capture()
                graph.launch()
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                for _ in range(20):
                    graph.launch()
                end.record(stream)
                end.synchronize()
            us = cp.cuda.get_elapsed_time(start, end) * 1e3 / (20 * 4 * a.layers)
            where = "72 KB shared, 3 CTAs an SM" if shared else "no shared memory"
            print(f"  {name:7s} {where:27s} {us:7.2f} µs  {nbytes / us / 1e6:.2f} TB/s  {fn.num_regs} registers")


if __name__ == "__main__":
    main()
