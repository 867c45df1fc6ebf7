"""Time a cross-SM hand-off on the GPU, alone and under a weight stream (GPU only).

    python tools/handoff_latency.py

A batch-1 decode step of a small model is a chain of hand-offs: every GEMV that splits its rows
over all SMs needs the whole vector the previous step wrote, so each step waits on one trip
through L2 from the slowest writer to every reader. This times that trip on its own, with one CTA
per SM passing a vector round (tools/handoff_latency.cu): for each protocol, with no other
traffic and under a stream of bulk copies of growing size (the rate it reaches is printed beside
the hop), and inside clusters of 8 CTAs through distributed shared memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from metrale_cli.kernels.registry import INCLUDE_DIR

SOURCE = Path(__file__).with_name("handoff_latency.cu")
PROTOCOLS = {0: "flagged words, 1 bf16 each", 1: "flagged words, 2 bf16 each", 2: "counter + plain vector"}
BLOCK, STAGES, STAGE_BYTES = 256 + 32, 4, 32768


def main() -> None:
    import cupy as cp
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hops", type=int, default=2000, help="hops per launch")
    parser.add_argument("--chunks", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384, 32768],
                        help="the stream's copy sizes in bytes (four in flight per SM)")
    args = parser.parse_args()
    sms = cp.cuda.Device(0).attributes["MultiProcessorCount"]
    n = 8 * sms
    source = SOURCE.read_text()
    stream = cp.zeros(2 << 30, dtype=cp.uint8)  # beyond L2, so the stream reaches HBM

    def build(proto: int, streaming: bool):
        options = ("-std=c++17", "-arch=sm_90", f"-I{INCLUDE_DIR}", f"-DHOP_PROTO={proto}",
                   f"-DHOP_STREAM={int(streaming)}")
        return cp.RawModule(code=source, options=options, backend="nvrtc")

    def per_hop(launch) -> float:
        times = []
        for _ in range(3):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            launch()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1000 / args.hops)
        return min(times)

    print(f"{sms} CTAs, a vector of {n} bf16, {args.hops} hops a launch")
    for proto, name in PROTOCOLS.items():
        for chunk in [0, *args.chunks]:
            fn = build(proto, chunk > 0).get_function("hop")
            fn.max_dynamic_shared_size_bytes = STAGES * STAGE_BYTES
            words = cp.zeros(2 * n, dtype=cp.uint64)
            plain = cp.zeros(2 * n, dtype=cp.uint16)
            counter = cp.zeros(1, dtype=cp.uint32)
            out = cp.zeros(2, dtype=cp.float32)

            def launch() -> None:
                words.fill(0)
                words[:n] = np.uint64(1) << np.uint64(32)  # hop 0's vector, flag 1
                counter.fill(0)
                fn((sms,), (BLOCK,), (words, plain, counter, np.int32(n), np.int32(args.hops), stream,
                                      np.int64(stream.nbytes), np.int32(max(chunk, 16)), np.uint32(1), out),
                   shared_mem=STAGES * STAGE_BYTES)

            us = per_hop(launch)
            if chunk:
                rate = float(out.get()[1]) * chunk * sms / (us * args.hops * 1e-6) / 1e12
                print(f"  {name:28s} stream of {chunk:5d} B copies: {us:6.3f} us a hop, stream {rate:4.2f} TB/s")
            else:
                print(f"  {name:28s} alone:                     {us:6.3f} us a hop")
    fn = build(0, False).get_function("hop_cluster")
    out = cp.zeros(2, dtype=cp.float32)
    for grid in (8, 64):
        us = per_hop(lambda: fn((grid,), (256,), (np.int32(args.hops), out)))
        print(f"  clusters of 8, {grid:3d} CTAs, DSMEM + cluster barrier: {us:6.3f} us a hop")


if __name__ == "__main__":
    main()
