"""Time the hand-off between consecutive decode launches on the GPU (figures, no asserts).

    python tools/launch_handoff.py

A batch-1 decode step is a chain of launches, each needing the whole vector the one before wrote.
This replays chains of `relay` launches (tools/launch_handoff.cu) from a CUDA graph and prints µs
a launch for three ways a launch learns its input is ready: stream order, a programmatic launch
with griddepcontrol.wait (today's decode kernels), and a programmatic launch that polls a counter
its predecessor's CTAs add to after their stores. Each at grids of one and two CTAs an SM, with
no weights and with a GEMV's worth of weights streamed by every launch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from metrale_cli.kernels.loader import _launch_ex, _pdl_driver
from metrale_cli.kernels.registry import INCLUDE_DIR

SOURCE = Path(__file__).with_name("launch_handoff.cu")
MODES = {0: "stream order", 1: "programmatic, griddepcontrol.wait", 2: "programmatic, counter poll"}


def main() -> None:
    import cupy as cp
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=96)
    parser.add_argument("--n", type=int, default=2048, help="the vector's bf16 elements")
    parser.add_argument("--mb", type=float, nargs="*", default=[0.0, 4.0, 16.8], help="weights a launch streams")
    args = parser.parse_args()
    sms = cp.cuda.Device(0).attributes["MultiProcessorCount"]
    raw = cp.RawModule(code=SOURCE.read_text(), options=("-std=c++17", "-arch=sm_90", f"-I{INCLUDE_DIR}"),
                       backend="nvrtc")
    fn = raw.get_function("relay")
    driver = _pdl_driver()
    stream = cp.cuda.Stream(non_blocking=True)
    L = args.launches
    vecs = [cp.full(args.n * 4, 0x3f80, dtype=cp.uint16) for _ in range(2)]
    counters = cp.zeros(L, dtype=cp.uint32)
    sink = cp.zeros(1, dtype=cp.float32)
    print(f"{sms} SMs; chains of {L} launches, a vector of {args.n} bf16, µs a launch")
    for mb in args.mb:
        chunks_total = int(mb * 1e6 / 16)
        # a ring of weight buffers, 160 MB in all: beyond L2, so each launch streams from HBM
        ring = min(L, -(-160 // int(mb))) if mb else 1
        weights = [cp.zeros(max(chunks_total, 1) * 16, dtype=cp.uint8) for _ in range(ring)]
        for grid in (sms, 2 * sms):
            for early in (0, 1) if mb else (0,):
                for mode, name in MODES.items():
                    def chain():
                        counters.fill(0)
                        for i in range(L):
                            w = weights[i % len(weights)]
                            typed = [vecs[i % 2].data.ptr, vecs[(i + 1) % 2].data.ptr, w.data.ptr,
                                     np.uint64(chunks_total), counters.data.ptr + 4 * (i - 1) if (mode == 2 and i) else 0,
                                     counters.data.ptr + 4 * i, np.int32(grid), np.int32(args.n), np.int32(mode),
                                     np.int32(early), sink.data.ptr]
                            typed = [np.uint64(t) if isinstance(t, int) else t for t in typed]
                            if mode == 0 or i == 0:
                                fn((grid,), (256,), tuple(typed), stream=stream)
                            else:
                                _launch_ex(driver, fn, (grid,), (256,), 0, stream.ptr, typed)
                    with stream:
                        stream.begin_capture()
                        chain()
                        graph = stream.end_capture()
                        graph.launch(stream)
                        stream.synchronize()
                        times = []
                        for _ in range(5):
                            start, end = cp.cuda.Event(), cp.cuda.Event()
                            start.record(stream)
                            for _ in range(10):
                                graph.launch(stream)
                            end.record(stream)
                            end.synchronize()
                            times.append(cp.cuda.get_elapsed_time(start, end) * 1000 / (10 * L))
                    rate = f", {mb * 1e6 / (min(times) * 1e-6) / 1e12:4.2f} TB/s" if mb else ""
                    print(f"  {mb:5.1f} MB, grid {grid:3d}{', early' if early else '       '}  {name:36s} "
                          f"{min(times):6.2f}{rate}")


if __name__ == "__main__":
    main()
