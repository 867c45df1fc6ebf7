"""What one tensor-parallel rank runs in the tests (``metrale_cli.engine.ranks.run_ranks`` spawns the
other ranks, which import this module by name; :func:`on_one_gpu` runs ranks that share a GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_oracle import greedy_and_logits
from metrale_cli.engine.runner import RunnerOptions, open_runner
from metrale_cli.engine.sampler import SamplingParams
from metrale_cli.engine.source import ModelSource
from metrale_cli.layers.parallel import TensorParallel


def greedy(tp, device, output, raw: dict, tensors: dict[str, torch.Tensor], prompt: list[int], n: int,
           chunk: int = 7):
    """n greedy tokens after ``prompt`` from HF-named ``tensors`` on the torch backend in fp32, and
    the teacher-forced logits that chose them (prefill chunks of ``chunk`` tokens, so the prompt
    takes several)."""
    opts = RunnerOptions(backend="torch", dtype="fp32", max_seq_len=128, reserve_all_memory=False,
                         prefill_chunk=chunk, kv_promote_minimum=False)
    runner = open_runner(opts, ModelSource.loaded(raw, tensors, None, raw["model_type"]), tp=tp)
    return greedy_and_logits(runner, prompt, n)


def fails_on_rank_one(tp, device, output):
    """Rank 1 fails at start-up; rank 0 goes on into a collective that rank 1 never joins."""
    from metrale_cli.errors import MetraleError

    if tp.rank == 1:
        raise MetraleError("rank one cannot start", hint="a hint for rank one")
    return float(tp.reduce(torch.ones(1)))


def row_path(runner) -> list[bool]:
    """Which layers take batch 1's fused row path (norm + projection, projection + residual add,
    the FFN's own row path)."""
    return [layer.fused_decode for layer in runner.model.layers]


def greedy_row_path(tp, device, output, raw: dict, tensors: dict[str, torch.Tensor], prompt: list[int], n: int,
                    backend: str = "torch", dtype: str = "fp32"):
    """n greedy tokens after ``prompt`` through batch 1's fused row path: on the cuda backend its
    kernels, on the torch backend (switched on) each fused launch's reference, the cuda backend's
    wiring (the residual added by rank 0 alone, the sums over the ranks after the fused
    projections). No CUDA graph (a host-staged sum cannot be captured). -> (ids, each token's
    logprob record (``Sequence.logprobs``: its log-probability, the 5 likeliest), :func:`row_path`):
    the records of tokens 1 .. n - 1 are the decode steps' own (a teacher-forced prefill's logits
    are not)."""
    from metrale_cli.kernels.reference import TorchOps

    serves = TorchOps.__dict__["gemv_fits"]  # the staticmethod itself, put back as it was
    TorchOps.gemv_fits = staticmethod(lambda k, dtype: True)
    try:
        opts = RunnerOptions(backend=backend, dtype=dtype, max_seq_len=256, reserve_all_memory=False,
                             prefill_chunk=37, cuda_graph_mode="disabled", kv_promote_minimum=False)
        runner, seq = _greedy_logprobs(opts, tp, device, raw, tensors, prompt, n)
        return seq.output_ids, seq.logprobs, row_path(runner)
    finally:
        TorchOps.gemv_fits = serves


def greedy_graphed(tp, device, output, raw: dict, tensors: dict[str, torch.Tensor], prompt: list[int], n: int,
                   all_reduce: str = "one-shot"):
    """n greedy tokens after ``prompt`` on the cuda backend in bf16, each decode step replayed as a
    CUDA graph with the ranks' sums and the LM head's gather captured in it (``all_reduce``
    one-shot: the one-shot kernels over the buffers the ranks' processes map from each other).
    -> (ids, each token's logprob record, the batch sizes whose graphs were captured)."""
    opts = RunnerOptions(backend="cuda", dtype="bf16", max_seq_len=256, reserve_all_memory=False,
                         prefill_chunk=37, cuda_graph_mode="full", all_reduce=all_reduce, kv_promote_minimum=False)
    runner, seq = _greedy_logprobs(opts, tp, device, raw, tensors, prompt, n)
    return seq.output_ids, seq.logprobs, sorted(runner.engine.graphs.graphs)


def _greedy_logprobs(opts: RunnerOptions, tp, device, raw: dict, tensors: dict[str, torch.Tensor],
                     prompt: list[int], n: int):
    """(the runner, the sequence of n greedy tokens after ``prompt`` with each token's logprob
    record), the tensors moved to ``device`` first where there is one."""
    if device is not None:
        tensors = {name: t.to(device) for name, t in tensors.items()}
    runner = open_runner(opts, ModelSource.loaded(raw, tensors, None, raw["model_type"]), tp=tp)
    seqs, _ = runner.engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=5))
    return runner, seqs[0]


@dataclass(frozen=True)
class HostStaged(TensorParallel):
    """A rank whose collectives go through host memory (gloo), so that ranks may share one GPU:
    each sum in fp32, rounded once to the tensor's dtype (NCCL's sum of two bf16 parts)."""

    def _group_sum(self, x: torch.Tensor) -> None:
        import torch.distributed as dist

        total = x.float().cpu()
        dist.all_reduce(total, group=self.group)
        x.copy_(total)

    def _group_gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        part = x.contiguous().cpu()
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat(parts, dim=-1).to(x.device)


def on_one_gpu(size: int, target, *args):
    """``target(tp, device, None, *args)`` on ``size`` ranks in spawned processes that all use
    cuda:0, their collectives staged through the host (:class:`HostStaged`); returns rank 0's
    result, or raises the first rank's error."""
    import multiprocessing

    from metrale_cli.engine.ranks import free_port

    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_one_gpu_rank, args=(rank, size, port, results, target, args), daemon=True)
             for rank in range(size)]
    for p in procs:
        p.start()
    try:
        rank, ok, value = results.get(timeout=900)
        if not ok:
            raise RuntimeError(f"rank {rank}: {value}")
        return value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()


def _one_gpu_rank(rank: int, size: int, port: int, results, target, args) -> None:
    import torch.distributed as dist

    try:
        if size > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        tp = HostStaged(rank, size, dist.group.WORLD if size > 1 else None)
        torch.cuda.set_device(0)
        value = target(tp, torch.device("cuda", 0), None, *args)
        if rank == 0:
            results.put((rank, True, value))
    except BaseException as e:  # noqa: BLE001 - reported by the test
        import traceback

        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if size > 1 and dist.is_initialized():
            dist.destroy_process_group()
