"""One-shot collectives of tensor-parallel ranks (``kernels_cu/all_reduce.cu``): the sum after a
row-parallel projection and the LM head's gather, each one launch that reads every rank's part
from buffers the ranks map into each other's address space (CUDA IPC), for a decode step's small
tensors. Graph-capturable wherever the ranks' GPUs can map each other's memory (one GPU, or
peers over NVLink); `--all-reduce one-shot` picks them over NCCL for what fits their buffers,
NCCL (or the group's backend) taking the rest.
"""

from __future__ import annotations

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.table import (
    ONE_SHOT_BLOCKS, ONE_SHOT_GATHER, ONE_SHOT_MAX_RANKS, ONE_SHOT_SIGNAL_BYTES, ONE_SHOT_SUM, ONE_SHOT_THREADS,
)


class OneShot:
    """This rank's side of the one-shot collectives: ``data`` / ``signals``, every rank's buffers'
    addresses in rank order (int64 on this rank's device); a data buffer holds two halves of
    ``capacity`` bytes. Every rank must make the same calls in the same order (the kernels count
    their epochs on the device)."""

    def __init__(self, rank: int, ranks: int, data: list[int], signals: list[int], capacity: int,
                 device: torch.device, launcher=None):
        if not 2 <= ranks <= ONE_SHOT_MAX_RANKS:
            raise MetraleError(f"one-shot collectives serve 2 to {ONE_SHOT_MAX_RANKS} ranks, not {ranks}",
                               hint="use --all-reduce nccl")
        from metrale_cli.kernels.cuda_launch import CudaLauncher

        device = _indexed(device)
        self.rank, self.ranks, self.capacity, self.device = rank, ranks, capacity, device
        self.data = torch.tensor(data, dtype=torch.int64, device=device)
        self.signals = torch.tensor(signals, dtype=torch.int64, device=device)
        self.launcher = launcher or CudaLauncher()
        for kernel, _ in (ONE_SHOT_SUM, ONE_SHOT_GATHER):  # both load now: a missing one fails at start-up
            self.launcher.loader.function(kernel, device)

    @classmethod
    def over_group(cls, rank: int, ranks: int, group, device: torch.device, capacity: int, launcher=None) -> OneShot:
        """Each rank allocates its buffers, and the group exchanges their IPC handles (a collective
        of ``group``: every rank calls this together). The buffers and mappings last as long as the
        process: freeing memory that a peer still maps is undefined in CUDA IPC."""
        import cupy
        import torch.distributed as dist

        rt = cupy.cuda.runtime
        device = _indexed(device)
        with cupy.cuda.Device(device.index):
            data = rt.malloc(2 * capacity)
            signal = rt.malloc(ONE_SHOT_SIGNAL_BYTES)
            rt.memset(signal, 0, ONE_SHOT_SIGNAL_BYTES)
            rt.deviceSynchronize()  # zeroed before any peer can publish a flag into it
            handles = (rt.ipcGetMemHandle(data), rt.ipcGetMemHandle(signal))
        everyone: list = [None] * ranks
        dist.all_gather_object(everyone, handles, group=group)
        datas, signals = [], []
        with cupy.cuda.Device(device.index):
            for r, (data_handle, signal_handle) in enumerate(everyone):
                if r == rank:
                    datas.append(data), signals.append(signal)
                    continue
                try:
                    mapped = (rt.ipcOpenMemHandle(data_handle), rt.ipcOpenMemHandle(signal_handle))
                except Exception as e:  # noqa: BLE001 - CuPy's CUDARuntimeError: no peer access
                    raise MetraleError(f"--all-reduce one-shot: rank {rank} cannot map rank {r}'s buffers ({e})",
                                       hint="GPUs without peer access to each other need --all-reduce nccl") from None
                datas.append(mapped[0]), signals.append(mapped[1])
        dist.barrier(group=group)  # every rank mapped every buffer before any launch
        return cls(rank, ranks, datas, signals, capacity, device, launcher)

    def sums(self, x: torch.Tensor) -> bool:
        """Whether :meth:`sum_` serves ``x``: bf16 on this device, a multiple of 8 elements that
        fits a buffer's half."""
        return (x.dtype == torch.bfloat16 and x.device == self.device and x.is_contiguous()
                and x.numel() % 8 == 0 and x.numel() * 2 <= self.capacity and x.data_ptr() % 16 == 0)

    def gathers(self, x: torch.Tensor) -> bool:
        """Whether :meth:`gather_columns` serves ``x``: fp32 (rows, cols) on this device, cols a
        multiple of 4, fitting a buffer's half."""
        return (x.dtype == torch.float32 and x.device == self.device and x.dim() == 2 and x.is_contiguous()
                and x.shape[1] % 4 == 0 and x.numel() * 4 <= self.capacity and x.data_ptr() % 16 == 0)

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` becomes the sum over the ranks of their ``x`` (each sum in fp32, rounded once)."""
        self.launcher._launch(ONE_SHOT_SUM, (ONE_SHOT_BLOCKS,), (ONE_SHOT_THREADS,), x, x, self.data, self.signals,
                              x.numel(), self.rank, self.ranks, self.capacity // 2)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (rows, cols) side by side, rank 0's first."""
        rows, cols = x.shape
        out = torch.empty(rows, cols * self.ranks, dtype=x.dtype, device=x.device)
        self.launcher._launch(ONE_SHOT_GATHER, (ONE_SHOT_BLOCKS,), (ONE_SHOT_THREADS,), x, out, self.data,
                              self.signals, rows, cols, self.rank, self.ranks, self.capacity // 4)
        return out


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` alone is the current device), as a tensor's device reads."""
    return device if device.index is not None else torch.device(device.type, torch.cuda.current_device())


_KEPT: dict[tuple[int, int], OneShot] = {}  # by (id(group), device index)


def one_shot_for_group(rank: int, ranks: int, group, device: torch.device, capacity: int, launcher=None) -> OneShot:
    """The group's one-shot collectives on ``device`` with at least ``capacity`` bytes a half: the
    ones an earlier runner of this process mapped (a bench builds a runner per KV dtype and case),
    else new ones (a collective: every rank asks for the same capacity, as every rank runs the same
    cases). A smaller earlier pair stays mapped: it is not freed while a peer may still map it."""
    device = _indexed(device)
    key = (id(group), device.index)
    kept = _KEPT.get(key)
    if kept is None or kept.capacity < capacity:
        kept = _KEPT[key] = OneShot.over_group(rank, ranks, group, device, capacity, launcher)
    return kept
