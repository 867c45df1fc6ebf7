"""Tensor-parallel processes: one rank each, started by the command (rank 0 in its own process),
joined in one torch.distributed group; a rank that fails stops the others."""

from __future__ import annotations

import os

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.layers.parallel import SINGLE, TensorParallel


# --- the process group ---------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, size: int, port: int, timeout_s: float = 600.0) -> tuple[TensorParallel, torch.device]:
    """This process as ``rank`` of ``size`` (NCCL and GPU ``rank`` where there is a GPU, gloo and
    the CPU otherwise), meeting the others at 127.0.0.1:``port``."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off unless the user turned it on
    cuda = torch.cuda.is_available()
    if cuda:
        if torch.cuda.device_count() < size:
            raise MetraleError(f"--tensor-parallel-size {size} needs {size} GPUs, torch sees "
                               f"{torch.cuda.device_count()}", hint="lower --tensor-parallel-size")
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=timeout_s),
                            **({"device_id": device} if cuda else {}))
    return TensorParallel(rank, size, dist.group.WORLD), device


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(size: int, target, *args, main_output=None, on_worker_error=None, **kwargs):
    """``target(tp, device, output, *args, **kwargs)`` on every rank of a new group of ``size``:
    ranks 1 .. size - 1 in spawned processes (``output`` None there), rank 0 in this process
    (``output`` is ``main_output``); returns rank 0's result. ``target`` and its arguments must
    pickle.

    A rank that fails stops the others, with no hang: rank 0's failure (its exception, raised
    here) terminates the workers; a worker's failure reaches rank 0 as its one-line error, which
    ``on_worker_error(message, hint)`` reports (else ``error:`` / ``hint:`` lines on stderr) before
    this process exits with status 1 (rank 0 may be waiting in a collective that will never
    complete)."""
    import multiprocessing
    import sys
    import threading
    import time

    if size < 1:
        raise MetraleError(f"--tensor-parallel-size must be at least 1, got {size}", hint="1 runs on one device")
    if size == 1:
        return target(SINGLE, None, main_output, *args, **kwargs)
    ctx = multiprocessing.get_context("spawn")
    port, failures, done, failure = free_port(), ctx.Queue(), threading.Event(), []
    workers = [ctx.Process(target=_worker, args=(rank, size, port, failures, target, args, kwargs), daemon=True)
               for rank in range(1, size)]
    for w in workers:
        w.start()

    def watch() -> None:
        while not done.wait(0.2):
            failed = [w for w in workers if w.exitcode not in (None, 0)]
            if not failed:
                continue
            try:
                failure.append(failures.get(timeout=2.0))
            except Exception:
                failure.append((f"tensor-parallel rank {workers.index(failed[0]) + 1} exited with status "
                                f"{failed[0].exitcode}", None))
            if done.wait(3.0):  # rank 0 stopped too (its collective failed): it reports the error
                return
            for w in workers:  # rank 0 is stuck in a collective that cannot complete
                if w.is_alive():
                    w.terminate()
            message, hint = failure[0]
            sys.stdout.flush()
            if on_worker_error is not None:
                on_worker_error(message, hint)
            else:
                print(f"error: {message}" + (f"\nhint: {hint}" if hint else ""), file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        tp, device = join_group(0, size, port)
        result = target(tp, device, main_output, *args, **kwargs)
        done.set()
        for w in workers:
            w.join(timeout=60)
        return result
    except BaseException as e:
        if not isinstance(e, MetraleError):  # a collective broken by a worker's failure: report that
            deadline = time.monotonic() + 3.0
            while not failure and time.monotonic() < deadline:
                time.sleep(0.05)
            if failure:
                done.set()
                raise MetraleError(*failure[0]) from None
        raise
    finally:
        done.set()
        for w in workers:
            if w.is_alive():
                w.terminate()
                w.join(timeout=10)
        leave_group()


def _worker(rank: int, size: int, port: int, failures, target, args, kwargs) -> None:
    """A spawned rank: joins the group, runs ``target``; a failure goes to rank 0 as one line."""
    import sys

    try:
        tp, device = join_group(rank, size, port)
        target(tp, device, None, *args, **kwargs)
    except MetraleError as e:
        failures.put((e.message, e.hint))
        sys.exit(1)
    except BaseException as e:  # reported by rank 0, once
        failures.put((f"tensor-parallel rank {rank}: {type(e).__name__}: {e}", None))
        sys.exit(1)
    finally:
        leave_group()
