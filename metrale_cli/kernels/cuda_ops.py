"""``CudaOps``: the :class:`~metrale_cli.kernels.ops.Ops` contract on CuPy-launched kernels.

Each method prepares outputs and goes through :meth:`KernelLoader.launch`, which checks every
argument. The paged-cache attention of a layer is a :class:`CudaPagedAttention` holding the
kernels of its KV dtype and head_dim (:func:`~metrale_cli.kernels.kv_kernels.kv_kernels`),
resolved once when the layer is built. Semantics are exactly the torch references' (``kernels/reference.py``); the GPU tests hold the two
together.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import cuda_launch, tensor_maps
from metrale_cli.kernels.cuda_attention import CudaPagedAttention
from metrale_cli.kernels.cuda_gdn import CudaGdn
from metrale_cli.kernels.cuda_launch import CudaLauncher, _ready
from metrale_cli.kernels.cuda_moe import CudaMoe
from metrale_cli.kernels.kv_kernels import WHT_KERNELS, kv_kernels
from metrale_cli.kernels.loader import KernelLoader
from metrale_cli.kernels.ops import STEP_MAX_SLICES, StepBuffers
from metrale_cli.kernels.registry import module_for
from metrale_cli.kernels.table import (
    ADD_RMS_NORM, DECODE_ADVANCE, GEMM_ROWS_KC, GEMM_ROWS_MAX, GEMM_ROWS_SIG, GEMM_ROWS_SWIGLU,
    GEMM_ROWS_SWIGLU_VARIANT, GEMM_ROWS_THREADS, GEMV_ADD,
    GEMV_CTAS_PER_SM, GEMV_GATE_ADD, GEMV_MAX_K, GEMV_NORM, GEMV_NORM_LOGITS,
    GEMV_NORM_SWIGLU, GEMV_THREADS, RMS_NORM, ROPE, SILU_AND_MUL, STEP_SLICE, STEP_THREADS, WHT_ROWS_PER_CTA,
    WHT_SIG, gemm_rows_launch, gemm_rows_variant,
)
from metrale_cli.kv.dtypes import KvCacheDtype


class CudaOps(CudaMoe, CudaGdn, CudaLauncher):
    """The CUDA backend of the kernel contract (see ``ops.py`` for shapes and dtypes)."""

    name = "cuda"
    moe_folds_shared = True

    def __init__(self, loader: KernelLoader | None = None):
        super().__init__(loader)
        self._attention: dict[tuple[KvCacheDtype, int], CudaPagedAttention] = {}

    def paged_attention(self, dtype: KvCacheDtype, head_dim: int) -> CudaPagedAttention:
        if (dtype, head_dim) in self._attention:
            return self._attention[dtype, head_dim]
        kernels = kv_kernels(dtype, head_dim)
        unserved = kernels.unserved()
        if unserved:
            raise MetraleError(
                f"kv-cache-dtype {dtype.value}: kernel(s) {', '.join(unserved)} do not serve head_dim {head_dim}",
                hint="use another --kv-cache-dtype or --backend torch for this model",
            )
        attention = self._attention[dtype, head_dim] = CudaPagedAttention(self, kernels)
        return attention

    def rms_norm(self, x, weight, eps):
        x2 = _ready(x.reshape(-1, x.shape[-1]))
        out = torch.empty_like(x2)
        if x2.shape[0]:
            block = (_norm_block(x2.shape[1]),)
            self._launch(RMS_NORM, (x2.shape[0],), block, x2, _ready(weight), out, x2.shape[1], eps, pdl=True)
        return out.view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps):
        x2, r2 = _ready(x.reshape(-1, x.shape[-1])), _ready(residual.reshape(-1, x.shape[-1]))
        out, total = torch.empty_like(x2), torch.empty_like(x2)
        if x2.shape[0]:
            block = (_norm_block(x2.shape[1]),)
            self._launch(
                ADD_RMS_NORM, (x2.shape[0],), block, x2, r2, _ready(weight), out, total,
                x2.shape[1], eps, pdl=True,
            )
        return out.view(x.shape), total.view(x.shape)

    def linear(self, x, weight, bias=None):
        """Up to GEMM_ROWS_MAX rows of bf16 with no bias and K a multiple of GEMM_ROWS_KC, in a
        shape where it is the faster (table.gemm_rows_variant): gemm_rows.cu; else (a prefill's
        rows, a bias, other shapes) cuBLAS through F.linear."""
        variant = rows_gemm_variant(x, weight, bias)
        if variant is None:
            return F.linear(x, weight, bias)
        return self.gemm_rows(x, weight, variant)

    def gemm_rows(self, x, weight, variant: tuple[int, int]):
        """gemm_rows.cu: x (M <= 16, K) bf16 times weight (N, K)ᵀ -> (M, N) in ``variant``
        (column tiles of 16 rows a CTA, ring stages: a key of table.GEMM_ROWS)."""
        x2, w = _ready(x), _ready(weight)
        rows, n, k = x2.shape[0], w.shape[0], w.shape[1]
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        spec, shared, grid = gemm_rows_launch(n, cuda_launch._sm_count(x.device.index), variant)
        self._launch((spec, GEMM_ROWS_SIG), (grid,), (GEMM_ROWS_THREADS,), tensor_maps.bf16_map(w, 16 * variant[0]),
                     tensor_maps.bf16_map(x2, 16), y, rows, n, k, shared_mem=shared, pdl=True)
        return y

    def linear_silu_and_mul(self, x, gate_up):
        """Where gemm_rows.cu can run it (``rows_gemm_variant``'s operand checks) and I is a
        multiple of 16: its SwiGLU entry, one launch; else the projection and silu_and_mul_bf16."""
        if not (_rows_gemm_fits(x, gate_up, None) and gate_up.shape[0] % 32 == 0):
            return self.silu_and_mul(self.linear(x, gate_up))
        return self.gemm_rows_swiglu(x, gate_up)

    def gemm_rows_swiglu(self, x, gate_up):
        """gemm_rows.cu's SwiGLU entry: x (M <= 16, K) bf16, gate_up (2I, K) -> silu(x gateᵀ) * (x upᵀ)
        (M, I), the bytes of silu_and_mul on the 2/4 variant's product."""
        x2, w = _ready(x), _ready(gate_up)
        rows, inter, k = x2.shape[0], w.shape[0] // 2, w.shape[1]
        y = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
        # the 2/4 variant's grid and shared memory: its 32-row tiles are 16 of gate and 16 of up
        _, shared, grid = gemm_rows_launch(2 * inter, cuda_launch._sm_count(x.device.index), GEMM_ROWS_SWIGLU_VARIANT)
        self._launch((GEMM_ROWS_SWIGLU, GEMM_ROWS_SIG), (grid,), (GEMM_ROWS_THREADS,), tensor_maps.bf16_map(w, 16),
                     tensor_maps.bf16_map(x2, 16), y, rows, inter, k, shared_mem=shared, pdl=True)
        return y

    def gemv_fits(self, k: int, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16 and k % 8 == 0 and 0 < k <= GEMV_MAX_K

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

    def gemv_add(self, x, weight, residual, gate=None):
        k = self._gemv_shape(x, weight)
        if residual is None:  # the kernel adds a row of zeros: bf16(0 + y) is y
            residual = self._zero_row(weight.shape[0], x.dtype, x.device)
        out = torch.empty(1, weight.shape[0], dtype=residual.dtype, device=residual.device)
        if gate is None:
            self._launch(GEMV_ADD, self._gemv_grid(x.device), (GEMV_THREADS,), weight, _ready(x), _ready(residual), out,
                         weight.shape[0], k, pdl=True)
        else:
            if gate.shape != x.shape:
                raise MetraleError(f"the output gate {tuple(gate.shape)} does not match the row {tuple(x.shape)}")
            self._launch(GEMV_GATE_ADD, self._gemv_grid(x.device), (GEMV_THREADS,), weight, _ready(x), _ready(gate),
                         _ready(residual), out, weight.shape[0], k, pdl=True)
        return out

    def _zero_row(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A (1, n) row of zeros that no kernel writes, kept per device, dtype and n (never
        replaced, so a captured graph replays on the same buffer)."""
        kept = self.__dict__.setdefault("_zero_rows", {})
        key = (device.index, dtype, n)
        if key not in kept:
            kept[key] = torch.zeros(1, n, dtype=dtype, device=device)
        return kept[key]

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
        if x.shape != (1, k) or not self.gemv_fits(k, weight.dtype):
            raise MetraleError(f"the decode GEMVs take one row of a multiple of 8 up to {GEMV_MAX_K} elements "
                               f"matching the weight's {k} bf16 columns, not {tuple(x.shape)} of {weight.dtype}")
        return k

    @staticmethod
    def _gemv_grid(device) -> tuple[int]:
        return (cuda_launch._sm_count(device.index) * GEMV_CTAS_PER_SM,)

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

    def wht(self, x, signs, inverse: bool):
        rows, head_dim = x.shape
        kernel = WHT_KERNELS[bool(inverse)], WHT_SIG
        served = module_for(kernel[0]).head_dims
        if head_dim not in served:
            raise MetraleError(f"the WHT kernels serve head_dim {served}, not {head_dim}")
        if rows:
            buf = _ready(x)
            self._launch(kernel, (math.ceil(rows / WHT_ROWS_PER_CTA),), (32 * WHT_ROWS_PER_CTA,),
                         buf, _ready(signs), rows, head_dim, pdl=True)
            if buf is not x:
                x.copy_(buf)
        return x

def _norm_block(hidden: int) -> int:
    return 256 if hidden >= 2048 else 128


def rows_gemm_variant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int] | None:
    """The gemm_rows.cu variant CudaOps.linear runs for these operands, or None (cuBLAS): where it
    can (1 to GEMM_ROWS_MAX rows of bf16 on an sm_90 GPU with tensor maps available, a contiguous,
    16-byte aligned 2-D bf16 weight, as loaded: never copied per call, K a multiple of
    GEMM_ROWS_KC, no bias) and table.gemm_rows_variant finds it the faster."""
    if not _rows_gemm_fits(x, weight, bias):
        return None
    return gemm_rows_variant(x.shape[0], weight.shape[0], weight.shape[1], cuda_launch._sm_count(x.device.index))


def _rows_gemm_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (bias is None and x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] <= GEMM_ROWS_MAX
            and x.dtype == weight.dtype == torch.bfloat16 and x.shape[1] == weight.shape[1]
            and weight.shape[1] % GEMM_ROWS_KC == 0 and weight.shape[0] > 0 and x.is_cuda
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0) and tensor_maps.available())
