"""``CudaOps``: the :class:`~metrale_cli.kernels.ops.Ops` contract on CuPy-launched kernels.

Each method prepares outputs, picks the kernels of the layer's KV dtype from the pools' side
types (:func:`~metrale_cli.kernels.table.kv_kernels`, built from the KV_DTYPES.md table in
``requirements.py``) and goes through :meth:`KernelLoader.launch`, which checks every argument.
Semantics are exactly the torch references' (``kernels/reference.py``); the GPU tests hold the two
together.
"""

from __future__ import annotations

import logging
import math

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.cuda_decode import CudaDecodeOps, _attention_kernels, _ready, _sm_count
from metrale_cli.kernels.decode_stack import StackPlan, stack_unserved
from metrale_cli.kernels.loader import KernelLoader
from metrale_cli.kernels.ops import STEP_MAX_SLICES, DecodeStack, SidePool, StepBuffers
from metrale_cli.kernels.registry import module_for
from metrale_cli.kernels.sdpa_prefill import sdpa_prefill
from metrale_cli.kernels.table import (
    ADD_RMS_NORM, ATTN_THREADS, DECODE_ADVANCE, DECODE_STACK, GEMV_ADD, GEMV_CTAS_PER_SM, GEMV_MAX_K, GEMV_NORM,
    GEMV_NORM_LOGITS, GEMV_NORM_SWIGLU, GEMV_THREADS, RMS_NORM, ROPE, SDPA_MIN_TOKENS, SILU_AND_MUL, STACK_BLOCK,
    STACK_SMEM_BYTES, STEP_SLICE, STEP_THREADS, WHT, WHT_ROWS_PER_CTA, _serves, dtype_of, kv_kernels, rows_per_cta,
)


log = logging.getLogger("metrale.kernels")


class CudaOps(CudaDecodeOps):
    """The CUDA backend of the kernel contract (see ``ops.py`` for shapes and dtypes)."""

    name = "cuda"

    def __init__(self, loader: KernelLoader | None = None):
        super().__init__()
        self.loader = loader or KernelLoader()

    def _launch(self, kernel, grid, block, *args, shared_mem: int = 0, pdl: bool = False):
        """``pdl``: a kernel that waits on its predecessor in-kernel (pdl.cuh), launched so that
        it may start during that predecessor's tail. ``shared_mem``: dynamic shared memory bytes."""
        spec, sig = kernel
        self.loader.launch(spec, sig, grid, block, *args, shared_mem=shared_mem, pdl=pdl)

    def rms_norm(self, x, weight, eps):
        x2 = _ready(x.reshape(-1, x.shape[-1]))
        out = torch.empty_like(x2)
        if x2.shape[0]:
            block = (_norm_block(x2.shape[1]),)
            self._launch(RMS_NORM, (x2.shape[0],), block, x2, _ready(weight), out, x2.shape[1], eps)
        return out.view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps):
        x2, r2 = _ready(x.reshape(-1, x.shape[-1])), _ready(residual.reshape(-1, x.shape[-1]))
        out, total = torch.empty_like(x2), torch.empty_like(x2)
        if x2.shape[0]:
            block = (_norm_block(x2.shape[1]),)
            self._launch(
                ADD_RMS_NORM, (x2.shape[0],), block, x2, r2, _ready(weight), out, total,
                x2.shape[1], eps,
            )
        return out.view(x.shape), total.view(x.shape)

    def gemv_fits(self, k: int) -> bool:
        return k % 8 == 0 and 0 < k <= GEMV_MAX_K

    def gemv_norm(self, x, residual, norm_weight, eps, weight):
        return self._gemv_norm(GEMV_NORM, weight.shape[0], x, residual, norm_weight, eps, weight)

    def gemv_norm_logits(self, x, residual, norm_weight, eps, weight):
        return self._gemv_norm(GEMV_NORM_LOGITS, weight.shape[0], x, residual, norm_weight, eps, weight,
                               torch.float32)[0]

    def gemv_norm_swiglu(self, x, residual, norm_weight, eps, gate_up):
        return self._gemv_norm(GEMV_NORM_SWIGLU, gate_up.shape[0] // 2, x, residual, norm_weight, eps, gate_up)

    def _gemv_norm(self, kernel, n, x, residual, norm_weight, eps, weight, out_dtype=None):
        k = self._gemv_shape(x, weight)
        x = _ready(x)
        out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
        s = x if residual is None else torch.empty_like(x)
        residual = None if residual is None else _ready(residual)
        self._launch(kernel, self._gemv_grid(x.device), (GEMV_THREADS,), weight, x, residual, _ready(norm_weight),
                     None if residual is None else s, out, n, k, eps, pdl=True)
        return out, s

    def gemv_add(self, x, weight, residual):
        k = self._gemv_shape(x, weight)
        out = torch.empty(1, weight.shape[0], dtype=residual.dtype, device=residual.device)
        self._launch(GEMV_ADD, self._gemv_grid(x.device), (GEMV_THREADS,), weight, _ready(x), _ready(residual), out,
                     weight.shape[0], k, pdl=True)
        return out

    def decode_advance(self, logits, step: StepBuffers, rows: int) -> None:
        slices, vocab = 1, 0
        if logits is not None:
            if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[0] != rows \
                    or not logits.is_contiguous():
                raise MetraleError(f"decode_advance takes contiguous ({rows}, vocab) float32 logits, "
                                   f"not {tuple(logits.shape)} {logits.dtype}")
            vocab = logits.shape[1]
            slices = min(STEP_MAX_SLICES, math.ceil(vocab / STEP_SLICE))
        if rows:
            self._launch(DECODE_ADVANCE, (slices, rows), (STEP_THREADS,), logits, vocab, step.next_tokens,
                         step.tokens, step.positions, step.seq_lens, step.slots, step.live, step.tables,
                         step.tables.shape[1], step.keys, step.counters)

    def _gemv_shape(self, x, weight) -> int:
        k = weight.shape[1]
        if x.shape != (1, k) or not self.gemv_fits(k):
            raise MetraleError(f"the decode GEMVs take one row of a multiple of 8 up to {GEMV_MAX_K} elements "
                               f"matching the weight's {k} columns, not {tuple(x.shape)}")
        return k

    @staticmethod
    def _gemv_grid(device) -> tuple[int]:
        return (_sm_count(device.index) * GEMV_CTAS_PER_SM,)

    def decode_stack_plan(self, stack: DecodeStack) -> StackPlan | None:
        """decode_stack.cu's buffers for ``stack`` where that kernel serves it (``stack_unserved``),
        else None (logged with the reason)."""
        why = stack_unserved(stack)
        if why:
            log.info("whole-stack decode not used: %s", why)
            return None
        return StackPlan(stack)

    def decode_stack(self, plan: StackPlan, hidden, ctx):
        stack = plan.stack
        if hidden.shape != (1, plan.hidden) or ctx.block_tables is None or ctx.block_tables.shape[0] != 1:
            raise MetraleError(f"the whole-stack decode step takes one sequence's (1, {plan.hidden}) row, "
                               f"not {tuple(hidden.shape)}")
        hidden, table = _ready(hidden), _ready(ctx.block_tables[0])
        sms = _sm_count(hidden.device.index)
        self._launch(
            DECODE_STACK, (sms,), (STACK_BLOCK,), plan.table, len(stack.layers), hidden, plan.words, plan.part_o,
            plan.part_ml, plan.sync, table, _ready(ctx.seq_lens), _ready(ctx.slot_mapping),
            _ready(ctx.positions), plan.cos, plan.sin, plan.hidden, stack.num_heads, stack.num_kv_heads,
            stack.head_dim, plan.rot_dim, plan.inter, plan.splits(sms, table.shape[0]), stack.eps, stack.scale,
            shared_mem=STACK_SMEM_BYTES, pdl=True,
        )
        return hidden

    def rope(self, q, k, positions, cos, sin):
        q, k = _ready(q), _ready(k)
        if q.shape[0]:
            pairs = (q.shape[1] + k.shape[1]) * cos.shape[-1]
            self._launch(
                ROPE, (q.shape[0], math.ceil(pairs / 128)), (128,), q, k, _ready(positions), _ready(cos), _ready(sin),
                q.shape[1], k.shape[1], q.shape[2], cos.shape[-1] * 2,
            )
        return q, k

    def silu_and_mul(self, gate_up):
        gate_up = _ready(gate_up)
        tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
        if tokens and inter:
            self._launch(SILU_AND_MUL, (tokens, math.ceil(inter / (128 * 8))), (128,), gate_up, out, inter)
        return out

    def reshape_and_cache(self, k, v, k_pool: SidePool, v_pool: SidePool, slot_mapping):
        tokens, hk, head_dim = k.shape
        kernels = kv_kernels(dtype_of(k_pool, v_pool), head_dim)
        if not tokens:
            return
        channel = k_pool.channel_scale
        values = dict(
            k=_ready(k), v=_ready(v), k_cache=k_pool.data, v_cache=v_pool.data,
            slot_mapping=_ready(slot_mapping), k_scale=k_pool.scale, v_scale=v_pool.scale,
            k_signs=k_pool.signs, v_signs=v_pool.signs,
            channel_scale=None if channel is None else _ready(channel), hk=hk, head_dim=head_dim,
        )
        spec, sig = kernels.write
        grid, block = ((tokens, hk), (64,)) if kernels.write_per_head else ((tokens,), (128,))
        self.loader.launch(spec, sig, grid, block, *(values[name] for name, _ in sig.params))

    def paged_prefill(self, q, k_pool: SidePool, v_pool: SidePool, block_table, start_pos, scale,
                      use_kernel: bool = False):
        """Chunks of SDPA_MIN_TOKENS or more tokens go to :func:`sdpa_prefill`; shorter ones, and
        any chunk when ``use_kernel`` (kernel tests), to the dtype's paged prefill kernel."""
        kernels = _attention_kernels(q, k_pool, v_pool)
        tokens, hq, head_dim = q.shape
        if tokens >= SDPA_MIN_TOKENS and not use_kernel:
            return sdpa_prefill(q, k_pool, v_pool, block_table, start_pos, scale)
        hk = k_pool.num_kv_heads
        q, out = _ready(q), torch.empty_like(q)
        if tokens:
            rows = math.ceil(tokens * (hq // hk) / rows_per_cta(head_dim))
            if rows > 65535:
                raise MetraleError(
                    f"prefill chunk of {tokens} tokens is too long for one launch",
                    hint="prefill in chunks of at most 8192 tokens",
                )
            self._launch(
                kernels.prefill, (hk, rows), (ATTN_THREADS,), q, k_pool.data, v_pool.data,
                _ready(block_table), out, k_pool.scale, v_pool.scale, scale, tokens, start_pos, hq, hk,
                head_dim,
            )
        return out

    def wht(self, x, signs, inverse: bool):
        rows, head_dim = x.shape
        kernel = WHT[bool(inverse)]
        if not _serves(kernel[0], head_dim):
            raise MetraleError(f"the WHT kernels serve head_dim {module_for(kernel[0]).head_dims}, "
                               f"not {head_dim}")
        if rows:
            buf = _ready(x)
            self._launch(kernel, (math.ceil(rows / WHT_ROWS_PER_CTA),), (32 * WHT_ROWS_PER_CTA,),
                         buf, _ready(signs), rows, head_dim)
            if buf is not x:
                x.copy_(buf)
        return x

def _norm_block(hidden: int) -> int:
    return 256 if hidden >= 2048 else 128
