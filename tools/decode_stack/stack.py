"""The whole-stack batch-1 decode step (decode_stack.cu beside this file): one persistent launch
through every layer of a small dense bf16 model with a bf16 KV cache.

A measurement tool, not a path of metrale: on an H200 it trails the per-layer launches
(docs/performance.md, commits ff536fa to bc6ae9d). It keeps its own types, its torch reference,
its planner and its launch here, and launches through metrale's ``KernelLoader``:

- :class:`DecodeStack` / :class:`StackLayer`: a stack's weights, norms and layer caches;
  :func:`stack_of` takes them from a built ``CausalLM``;
- :func:`decode_stack_reference`: what the kernel computes, through an ``Ops`` backend's
  single-layer calls (the layers' batch-1 decode path);
- :func:`stack_unserved` / :class:`StackPlan` / :func:`decode_stack`: which stacks the kernel
  serves, the buffers a planned stack keeps, the launch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale_cli.kernels import cuda_launch
from metrale_cli.kernels.loader import KernelLoader, device_arch
from metrale_cli.kernels.registry import KERNELS_DIR, KernelModule, KernelSpec
from metrale_cli.kernels.table import MAX_SPLITS, MIN_KEYS_PER_SPLIT, TC_ROWS, Signature
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.kv.pool import LayerKv

# The module, compiled with metrale's headers (kernels_cu/include); its path relative to kernels_cu/.
SOURCE = Path(__file__).with_name("decode_stack.cu")
MODULE = KernelModule("decode_stack", os.path.relpath(SOURCE, KERNELS_DIR), (), ("decode_stack_bf16",),
                      head_dims=(64, 128))
KERNEL = KernelSpec("decode_stack", "decode_stack_bf16"), Signature.parse(
    "layers: i64*, num_layers: i32, h: bf16*, words: i64*, part_o: f32*, part_ml: f32*, sync: i32*, "
    "block_table: i32*, seq_lens: i32*, slot_mapping: i32*, positions: i32*, cos: f32*, sin: f32*, "
    "hidden: i32, hq: i32, hk: i32, head_dim: i32, rot_dim: i32, inter: i32, num_splits: i32, eps: f32, scale: f32"
)
# decode_stack.cu's constants: its CTA, weight ring stage, widest GEMV row and shared memory
STACK_BLOCK = 288  # eight consumer warps and the weight producer's
STACK_STAGE_BYTES = 32768
STACK_MAX_K = 12288
STACK_MIN_ROWS = 4  # rows (gate/up pairs) per ring stage the planner asks of every projection
STACK_MAX_LAYERS = 128
STACK_MAX_OWN = 256  # rows of the hidden state one CTA owns
STACK_SMEM_BYTES = (5 * STACK_STAGE_BYTES + 33280 + 8 * 128 * 2 + 128 * 2 + 8 * 128 * 2 + STACK_MAX_LAYERS * 4 * 8
                    + STACK_MAX_OWN * 2 + 2 * 5 * 8 + 16)


@dataclass
class StackLayer:
    """One layer's part of a whole-stack decode step: its weights, norms (``q_norm`` / ``k_norm``
    None without QK-norm) and bf16 layer cache."""

    qkv: torch.Tensor  # (Hq*D + 2*Hk*D, hidden)
    o: torch.Tensor  # (hidden, Hq*D)
    gate_up: torch.Tensor  # (2I, hidden)
    down: torch.Tensor  # (hidden, I)
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    kv: LayerKv


@dataclass
class DecodeStack:
    """A dense model's layers as one batch-1 decode step: pre-norm attention (fused q/k/v, QK-norm,
    neox RoPE from ``cos`` / ``sin``) and a SwiGLU FFN, no biases, per layer."""

    layers: list[StackLayer]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    cos: torch.Tensor
    sin: torch.Tensor


def stack_of(model) -> DecodeStack | None:
    """A built ``CausalLM``'s layers as a :class:`DecodeStack`, or None where a layer is not the
    plain dense one the kernel computes (biases, no fused batch-1 path, calibration not frozen)."""
    parts = []
    for layer in model.layers:
        ffn, w = layer.ffn, layer.weights
        if not (layer.fused_decode and layer.frozen() and hasattr(ffn, "gate_up")):
            return None
        parts.append(StackLayer(w.qkv, w.o, ffn.gate_up, ffn.down, layer.input_norm, layer.ffn_norm, w.q_norm,
                                w.k_norm, layer.kv))
    first = model.layers[0]
    attn = first.spec.attention
    return DecodeStack(parts, attn.num_heads, attn.num_kv_heads, attn.head_dim, first.eps, attn.scale,
                       first.rope_cos, first.rope_sin)


def decode_stack_reference(ops, stack: DecodeStack, hidden: torch.Tensor, ctx) -> torch.Tensor:
    """What :func:`decode_stack` computes, through ``ops``' single-layer calls (the fused GEMVs,
    QK-norm + RoPE + cache write, paged decode): the layers' batch-1 decode path."""
    h, eps, d = hidden, stack.eps, stack.head_dim
    q_size, kv_size = stack.num_heads * d, stack.num_kv_heads * d
    attention = ops.paged_attention(KvCacheDtype.BF16, d)
    for layer in stack.layers:
        qkv, _ = ops.gemv_norm(h, None, layer.input_norm, eps, layer.qkv)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = attention.rope_and_cache(q.view(1, -1, d), k.view(1, -1, d), v.view(1, -1, d), layer.kv,
                                     ctx.slot_mapping, ctx.positions, stack.cos, stack.sin, layer.q_norm,
                                     layer.k_norm, eps)
        out = attention.paged_decode(q, layer.kv, ctx.block_tables, ctx.seq_lens, stack.scale)
        h = ops.gemv_add(out.reshape(1, q_size), layer.o, h)
        act, _ = ops.gemv_norm_swiglu(h, None, layer.post_norm, eps, layer.gate_up)
        h = ops.gemv_add(act, layer.down, h)
    return h


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
    if d not in MODULE.head_dims or hk == 0 or hq % hk:
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
        kv = layer.kv
        if kv.dtype != KvCacheDtype.BF16 or (kv.num_kv_heads, kv.head_dim) != (hk, d):
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
                        + [layer.kv.k.data.data_ptr(), layer.kv.v.data.data_ptr()])
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


def plan(stack: DecodeStack) -> StackPlan | None:
    """The kernel's buffers for ``stack`` where it serves it (:func:`stack_unserved`), else None."""
    return None if stack_unserved(stack) else StackPlan(stack)


def loader() -> KernelLoader:
    """A kernel loader that knows this tool's module."""
    return KernelLoader(extra={MODULE.name: MODULE})


def decode_stack(kernels: KernelLoader, plan: StackPlan, hidden: torch.Tensor, ctx) -> torch.Tensor:
    """One decode token through every layer of a planned stack: hidden (1, hidden) (the token's
    embedding; overwritten) -> the running sum after the last layer, as
    :func:`decode_stack_reference` computes it (the attention's fp32 sums may differ in order).
    ``ctx``: a one-sequence decode ``ForwardContext``; the new token's K / V are written."""
    stack = plan.stack
    if hidden.shape != (1, plan.hidden) or ctx.block_tables is None or ctx.block_tables.shape[0] != 1:
        raise ValueError(f"the whole-stack step takes one sequence's (1, {plan.hidden}) row, not {tuple(hidden.shape)}")
    hidden, table = _aligned(hidden), _aligned(ctx.block_tables[0])
    sms = cuda_launch._sm_count(hidden.device.index)
    kernels.launch(
        *KERNEL, (sms,), (STACK_BLOCK,), plan.table, len(stack.layers), hidden, plan.words, plan.part_o,
        plan.part_ml, plan.sync, table, _aligned(ctx.seq_lens), _aligned(ctx.slot_mapping), _aligned(ctx.positions),
        plan.cos, plan.sin, plan.hidden, stack.num_heads, stack.num_kv_heads, stack.head_dim, plan.rot_dim,
        plan.inter, plan.splits(sms, table.shape[0]), stack.eps, stack.scale, shared_mem=STACK_SMEM_BYTES, pdl=True,
    )
    return hidden


# --- fixtures of the tests and the profiling script ------------------------------------------------
def make_stack_case(layers: int, hidden: int, hq: int, hk: int, head_dim: int, inter: int, context: int,
                    seed: int = 0) -> dict:
    """CPU tensors for one batch-1 decode step of a random dense stack whose bf16 cache holds
    ``context`` earlier tokens: ``stack``, ``hidden`` (1, hidden) and a decode context
    (``block_tables``, ``seq_lens``, ``slot_mapping``, ``positions``) for the token at position
    ``context``. Weights are scaled so activations stay O(1) through the layers."""
    from metrale_cli.kernels.cases import make_paged_case

    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    parts, d, case = [], head_dim, None
    for i in range(layers):
        case = make_paged_case([context + 1], hq, hk, d, KvCacheDtype.BF16, seed=seed + i)
        parts.append(StackLayer(
            randn((hq + 2 * hk) * d, hidden, scale=hidden**-0.5), randn(hidden, hq * d, scale=(hq * d) ** -0.5),
            randn(2 * inter, hidden, scale=hidden**-0.5), randn(hidden, inter, scale=inter**-0.5),
            1 + randn(hidden, scale=0.1), 1 + randn(hidden, scale=0.1), 1 + randn(d, scale=0.1),
            1 + randn(d, scale=0.1), case["kv"],
        ))
    ang = torch.arange(context + 8)[:, None] * 0.01 ** (torch.arange(d // 2) / (d // 2))
    table = case["block_tables"]
    slot = table[0, context // 16] * 16 + context % 16
    return dict(stack=DecodeStack(parts, hq, hk, d, 1e-6, d**-0.5, ang.cos(), ang.sin()),
                hidden=randn(1, hidden), block_tables=table, seq_lens=case["seq_lens"],
                slot_mapping=slot.reshape(1).to(torch.int32), positions=torch.tensor([context], dtype=torch.int32))


def stack_to(stack: DecodeStack, device) -> DecodeStack:
    """A copy of a stack with every tensor (caches included) on ``device``."""
    from metrale_cli.kernels.cases import kv_to

    def move(t):
        return None if t is None else t.to(device).clone()

    layers = [StackLayer(*(kv_to(x.kv, device) if f.name == "kv" else move(getattr(x, f.name))
                           for f in dataclasses.fields(StackLayer))) for x in stack.layers]
    return DecodeStack(layers, stack.num_heads, stack.num_kv_heads, stack.head_dim, stack.eps, stack.scale,
                       move(stack.cos), move(stack.sin))
