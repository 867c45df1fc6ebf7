"""Whether a model's weights fit where they are to be loaded, checked before the first is read: on
the host an allocation past its memory is not an exception but the kernel's out-of-memory kill,
and on a GPU a load that fails halfway has taken minutes."""

from __future__ import annotations

import math

import torch

from metrale_cli.config import ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.layers.parallel import SINGLE, TensorParallel
from metrale_cli.models import family_of


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The bytes of the tensors ``cfg``'s family reads, in ``dtype`` (a tensor-parallel rank's
    shard where ``cfg`` is its shard_config)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) * size for shape in family_of(cfg.family).expected_tensors(cfg).values())


def free_bytes(device: torch.device) -> int | None:
    """What ``device`` can still hold: the GPU's free memory, the host's available memory (Linux's
    MemAvailable); None where the host does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# On the host, beside the weights and the KV pool: the activations of a prefill chunk and the
# allocator's slack. Past the host's memory an allocation is the kernel's kill, not an error line.
HOST_RESERVE = 512 << 20


def check_room(what: str, need: int, device: torch.device, tp: TensorParallel = SINGLE, smaller: str = "model",
               pool: int = 0) -> None:
    """Refuse ``what``'s weights (``need`` bytes; one rank's shard with ``tp``) where ``device``
    cannot hold them; on the host with ``pool`` bytes of KV pool and HOST_RESERVE beside them (a
    GPU's pool is sized after the weights, to what is left)."""
    free = free_bytes(device)
    host = device.type != "cuda"
    if free is None or need + (pool + HOST_RESERVE if host else 0) <= free:
        return
    shard = f" (a shard of {tp.size})" if tp.size > 1 else ""
    if host:
        beside = f" and its KV pool {pool / 1e9:.1f} GB" if pool else ""
        room = f"the host has {free / 1e9:.1f} GB free, of which {HOST_RESERVE / 1e9:.1f} GB is kept for activations"
        hint = (f"a smaller {smaller}" + (" or a shorter --max-seq-len" if pool else "")
                + ": on the CPU every weight is held in host memory")
    else:
        beside, room = "", f"the GPU has {free / 1e9:.1f} GB free"
        hint = f"a smaller {smaller}, or --tensor-parallel-size N to shard it over N GPUs"
    raise MetraleError(f"{what}'s weights{shard} take {need / 1e9:.1f} GB{beside}; {room}", hint=hint)


def check_pool_room(pool: int, device: torch.device) -> None:
    """On the host, refuse a KV pool of ``pool`` bytes that does not fit, with HOST_RESERVE, beside
    weights already in memory (a bench's); a GPU's pool is sized to what is left."""
    free = None if device.type == "cuda" else free_bytes(device)
    if free is None or pool + HOST_RESERVE <= free:
        return
    raise MetraleError(f"the KV pool takes {pool / 1e9:.1f} GB beside the weights in memory; the host has "
                       f"{free / 1e9:.1f} GB free, of which {HOST_RESERVE / 1e9:.1f} GB is kept for activations",
                       hint="shorter or fewer sequences (a bench's -p, -n and --batch; --max-seq-len), "
                            "or a smaller model")
