"""What every CuPy-launched op shares: the loader's typed launch, the device's SM count, aligned
inputs (rows of a fused projection passed without a copy), and the zeroed counters the one-launch
decode attention leaves zero."""

from __future__ import annotations

import functools

import torch

from metrale_cli.kernels.loader import KernelLoader


def _ready(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned, copying only when it is not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _head_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(T, H, D) whose heads are contiguous within a token (a view into a fused qkv output)
    -> (a contiguous 1-D view from its first element to its last, the token stride), so no
    copy is launched; a copy (``_ready``) only for another layout or a misaligned start."""
    tokens, heads, d = x.shape
    stride = x.stride(0) if tokens > 1 else heads * d
    if (x.stride(2) == 1 and (heads == 1 or x.stride(1) == d) and heads * d <= stride < 2**31
            and x.data_ptr() % 16 == 0):
        return x.as_strided(((tokens - 1) * stride + heads * d,), (1,)), stride
    return _ready(x), heads * d


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class CudaLauncher:
    """A kernel loader's launches, with the scratch the launches of a process share."""

    def __init__(self, loader: KernelLoader | None = None):
        self.loader = loader or KernelLoader()
        self._counters: dict[int, torch.Tensor] = {}  # per device: the fused decode's combine counters

    def _launch(self, kernel, grid, block, *args, shared_mem: int = 0, pdl: bool = False,
                cluster: tuple = (1, 1, 1)):
        """``pdl``: a kernel that waits on its predecessor in-kernel (pdl.cuh), launched so that
        it may start during that predecessor's tail. ``shared_mem``: dynamic shared memory bytes.
        ``cluster``: clusters of (x, y, z) CTAs (cluster.cuh)."""
        spec, sig = kernel
        clusters = {"cluster": tuple(cluster)} if tuple(cluster) != (1, 1, 1) else {}
        self.loader.launch(spec, sig, grid, block, *args, shared_mem=shared_mem, pdl=pdl, **clusters)

    def combine_counters(self, device: torch.device, count: int) -> torch.Tensor:
        """Zeroed int32 words, one per (sequence, KV head, chunk), that every fused decode launch
        leaves zero: kept per device and grown (never shrunk) so graphs replay on the same buffer."""
        have = self._counters.get(device.index)
        if have is None or have.numel() < count:
            have = self._counters[device.index] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        return have
