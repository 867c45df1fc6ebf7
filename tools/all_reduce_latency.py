"""Time one all-reduce of a decode step's size: NCCL against the one-shot sum (figures, no asserts).

    python tools/all_reduce_latency.py --ranks 2 [--kib 4 8 16 64 256 1024]

One process a GPU (the ranks of `--tensor-parallel-size`), an NCCL group between them. For each
message size (bf16 elements), each rank captures `--calls` all-reduces in a row into one CUDA
graph, as a decode step holds them, and replays it; rank 0 prints µs a call for NCCL's
`all_reduce` and for `kernels_cu/all_reduce.cu`'s `one_shot_sum_bf16` (`--all-reduce one-shot`),
the median of `--repeats` replays, and checks that both gave the same sums. Needs as many GPUs as
ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics


def rank_main(rank: int, ranks: int, port: int, kib: list[float], calls: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from metrale_cli.commands.timing import Timer
    from metrale_cli.kernels.cuda_collectives import OneShot

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            device_id=device)
    capacity = int(max(kib) * 1024)
    one = OneShot.over_group(rank, ranks, dist.group.WORLD, device, -(-capacity // 16) * 16)
    if rank == 0:
        print(f"{ranks} ranks ({torch.cuda.get_device_name(0)}); {calls} all-reduces a graph, median of "
              f"{repeats} replays, µs a call")
        print(f"{'KiB':>8} {'NCCL':>8} {'one-shot':>9}  same sums")
    for size in kib:
        n = max(8, int(size * 1024) // 2 // 8 * 8)
        g = torch.Generator(device=device).manual_seed(rank)
        base = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
        figures, results = [], []
        for name, reduce in (("nccl", lambda t: dist.all_reduce(t)), ("one-shot", one.sum_)):
            xs = [torch.empty_like(base) for _ in range(calls)]
            for x in xs:  # warm: NCCL's communicator and the kernels' loads
                x.copy_(base)
                reduce(x)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for x in xs:
                    reduce(x)
            times = []
            for _ in range(repeats):
                for x in xs:
                    x.copy_(base)
                dist.barrier()
                torch.cuda.synchronize()
                with Timer(device) as timer:
                    graph.replay()
                times.append(timer.seconds * 1e6 / calls)
            figures.append(statistics.median(times))
            results.append(xs[0].clone())
        if rank == 0:
            same = torch.equal(results[0], results[1])
            print(f"{size:>8.1f} {figures[0]:>8.2f} {figures[1]:>9.2f}  {'yes' if same else 'NO'}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import multiprocessing

    import torch

    from metrale_cli.engine.ranks import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--kib", type=float, nargs="*", default=[4, 8, 16, 32, 64, 256, 1024])
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"error: {args.ranks} ranks need {args.ranks} GPUs, torch sees {torch.cuda.device_count()}")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args.kib, args.calls, args.repeats))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
