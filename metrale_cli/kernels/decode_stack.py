"""The host side of the whole-stack batch-1 decode step (kernels_cu/decode_stack.cu): which stacks
the kernel serves, and the buffers a planned stack keeps for it. ``CudaOps.decode_stack_plan`` /
``decode_stack`` are the entry points.
"""

from __future__ import annotations

import math

import torch

from metrale_cli.kernels.loader import device_arch
from metrale_cli.kernels.ops import DecodeStack
from metrale_cli.kernels.table import (
    MAX_SPLITS, MIN_KEYS_PER_SPLIT, STACK_HEAD_DIMS, STACK_MAX_K, STACK_MAX_LAYERS, STACK_MAX_OWN, STACK_MIN_ROWS,
    STACK_SMEM_BYTES, STACK_STAGE_BYTES, TC_ROWS,
)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


_STACK_FIELDS = ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "q_norm", "k_norm")


def stack_unserved(stack: DecodeStack) -> str | None:
    """Why decode_stack.cu cannot run ``stack`` on its GPU, or None when it can."""
    if not 0 < len(stack.layers) <= STACK_MAX_LAYERS:
        return f"{len(stack.layers)} layers"
    first = stack.layers[0]
    device = first.qkv.device
    if device.type != "cuda":
        return "not on a GPU"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if int(device_arch(index)[3:]) < 90:
        return "it needs sm_90 (bulk asynchronous copies)"
    props = torch.cuda.get_device_properties(index)
    if props.shared_memory_per_block_optin < STACK_SMEM_BYTES:
        return f"it needs {STACK_SMEM_BYTES} bytes of shared memory per CTA"
    d, hq, hk = stack.head_dim, stack.num_heads, stack.num_kv_heads
    if d not in STACK_HEAD_DIMS or hk == 0 or hq % hk:
        return f"head_dim {d} with {hq} / {hk} heads"
    hidden, q_size, inter = first.qkv.shape[1], hq * d, first.down.shape[1]
    if any(k % 8 or not 0 < k <= STACK_MAX_K for k in (hidden, q_size, inter)):
        return f"GEMV rows of {hidden}, {q_size}, {inter} elements"
    # A warp reads one row of a ring stage: with fewer than STACK_MIN_ROWS rows per stage most warps
    # idle and the GEMV falls behind the weight stream (Qwen3-8B's down projection, one 24 KB row
    # a stage: 100 MB in 55 us, 1.8 TB/s, on an H200; 145 us a layer against about 120 through the
    # layers' own launches), so wider models keep those.
    rows = min(STACK_STAGE_BYTES // (2 * k) for k in (hidden, q_size, inter))
    if rows < STACK_MIN_ROWS:
        return f"{rows} weight rows per ring stage (rows of {hidden}, {q_size}, {inter} elements)"
    if stack.cos.shape[-1] * 2 > d:
        return "rot_dim > head_dim"
    if -(-hidden // props.multi_processor_count) > STACK_MAX_OWN:
        return f"{hidden} hidden rows over {props.multi_processor_count} SMs"
    want = {"qkv": (q_size + 2 * hk * d, hidden), "o": (hidden, q_size), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "input_norm": (hidden,), "post_norm": (hidden,), "q_norm": (d,), "k_norm": (d,)}
    for i, layer in enumerate(stack.layers):
        for name in _STACK_FIELDS:
            t = getattr(layer, name)
            if t is None and name in ("q_norm", "k_norm"):
                continue
            if t.dtype != torch.bfloat16 or tuple(t.shape) != want[name] or t.device != device:
                return f"layer {i}: {name} is {t.dtype} {tuple(t.shape)}"
        for pool in (layer.k_pool, layer.v_pool):
            if pool.data.dtype != torch.bfloat16 or pool.rotated or pool.channel_scale is not None \
                    or (pool.num_kv_heads, pool.head_dim) != (hk, d):
                return f"layer {i}: its KV cache is not a plain bf16 one"
    return None


class StackPlan:
    """decode_stack.cu's inputs that live as long as the model: the layer pointer table (its
    tensors are kept alive by ``stack``) and the step's scratch buffers."""

    def __init__(self, stack: DecodeStack):
        self.stack = stack
        first, d = stack.layers[0], stack.head_dim
        device = first.qkv.device
        self.hidden, self.inter = first.qkv.shape[1], first.down.shape[1]
        self.rot_dim = stack.cos.shape[-1] * 2
        hq, hk = stack.num_heads, stack.num_kv_heads
        chunks = math.ceil(hq // hk / TC_ROWS)
        self.items_per_split = hk * chunks
        rows, self._aligned = [], []  # copies of misaligned weights live here
        for layer in stack.layers:
            tensors = [None if getattr(layer, n) is None else _aligned(getattr(layer, n)) for n in _STACK_FIELDS]
            self._aligned += [t for t in tensors if t is not None]
            rows.append([0 if t is None else t.data_ptr() for t in tensors]
                        + [layer.k_pool.data.data_ptr(), layer.v_pool.data.data_ptr()])
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        # the flagged vectors a step hands between phases: q/k/v, attention, two running sums, SwiGLU
        self.words = torch.zeros((hq + 2 * hk) * d + hq * d + 2 * self.hidden + self.inter, dtype=torch.int64,
                                 device=device)
        self.part_o = torch.empty(hq, MAX_SPLITS, d, dtype=torch.float32, device=device)
        self.part_ml = torch.empty(hq, MAX_SPLITS, 2, dtype=torch.float32, device=device)
        self.sync = torch.zeros(2 + hk * chunks, dtype=torch.int32, device=device)
        self.cos, self.sin = _aligned(stack.cos), _aligned(stack.sin)

    def splits(self, sms: int, max_blocks: int) -> int:
        """Context splits of the attention phase: as many as fill the grid with (KV head, group
        chunk, split) items, each of at least MIN_KEYS_PER_SPLIT keys of the table."""
        return max(1, min(MAX_SPLITS, sms // self.items_per_split, max_blocks * 16 // MIN_KEYS_PER_SPLIT))
