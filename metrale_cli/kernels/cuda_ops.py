"""``CudaOps``: the :class:`~metrale_cli.kernels.ops.Ops` contract on CuPy-launched kernels.

Each method prepares outputs, picks the kernel from the cache dtype (one table per family) and
goes through :meth:`KernelLoader.launch`, which checks every argument. Semantics are exactly the
torch references' (``kernels/reference.py``); the GPU tests hold the two together.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.loader import KernelLoader, Signature
from metrale_cli.kernels.registry import KernelSpec

HEAD_DIMS = (64, 128, 256)  # instantiated in kernels_cu/include/paged_attention.cuh
ATTN_THREADS = 128
MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 32

K = KernelSpec.parse
RMS_NORM = K("rmsnorm::rms_norm_bf16"), Signature.parse(
    "x: bf16*, weight: bf16*, out: bf16*, hidden: i32, eps: f32"
)
ADD_RMS_NORM = K("rmsnorm::add_rms_norm_bf16"), Signature.parse(
    "x: bf16*, residual: bf16*, weight: bf16*, out: bf16*, sum_out: bf16*, hidden: i32, eps: f32"
)
ROPE = K("rope::rope_neox_bf16"), Signature.parse(
    "q: bf16*, k: bf16*, positions: i32*, cos: f32*, sin: f32*, hq: i32, hk: i32, head_dim: i32, rot_dim: i32"
)
SILU_AND_MUL = K("activation::silu_and_mul_bf16"), Signature.parse("gate_up: bf16*, out: bf16*, inter: i32")


@dataclass(frozen=True)
class KvKernels:
    """The kernels serving one cache element type."""

    cache_write: tuple[KernelSpec, Signature]
    decode: tuple[KernelSpec, Signature]
    combine: tuple[KernelSpec, Signature]
    prefill: tuple[KernelSpec, Signature]


def _kv_kernels(kv: str, suffix: str, write_sig: str) -> KvKernels:
    decode = (
        "q: bf16*, k_cache: {kv}*, v_cache: {kv}*, block_tables: i32*, seq_lens: i32*, out: bf16*, "
        "part_o: f32*?, part_ml: f32*?, k_scale: f32*?, v_scale: f32*?, scale: f32, hq: i32, hk: i32, "
        "head_dim: i32, max_blocks: i32, num_splits: i32"
    )
    prefill = (
        "q: bf16*, k_cache: {kv}*, v_cache: {kv}*, block_table: i32*, out: bf16*, k_scale: f32*?, "
        "v_scale: f32*?, scale: f32, tokens: i32, start_pos: i32, hq: i32, hk: i32, head_dim: i32"
    )
    combine = "part_o: f32*, part_ml: f32*, out: bf16*, hq: i32, head_dim: i32, num_splits: i32"
    return KvKernels(
        cache_write=(K(f"reshape_and_cache::reshape_and_cache_flash{suffix}"), Signature.parse(write_sig)),
        decode=(K(f"paged_decode{suffix}::paged_decode_attn{suffix}"), Signature.parse(decode.format(kv=kv))),
        combine=(K(f"paged_decode{suffix}::paged_decode_combine{suffix}"), Signature.parse(combine)),
        prefill=(
            K(f"prefill_paged{suffix}::attn_prefill_paged{suffix}"),
            Signature.parse(prefill.format(kv=kv)),
        ),
    )


_WRITE = (
    "k: bf16*, v: bf16*, k_cache: {kv}*, v_cache: {kv}*, slot_mapping: i32*{scales}, "
    "hk: i32, head_dim: i32"
)
KV_KERNELS: dict[torch.dtype, KvKernels] = {
    torch.bfloat16: _kv_kernels("bf16", "", _WRITE.format(kv="bf16", scales="")),
    torch.float8_e4m3fn: _kv_kernels(
        "fp8", "_fp8", _WRITE.format(kv="fp8", scales=", k_scale: f32*, v_scale: f32*")
    ),
}


def rows_per_cta(head_dim: int) -> int:
    """Mirror of ``RowsPerCta<D>`` in paged_attention.cuh."""
    return 8 if head_dim <= 128 else 4


def _ready(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned, copying only when it is not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _kv_for(k_cache: torch.Tensor, v_cache: torch.Tensor) -> KvKernels:
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in KV_KERNELS:
        raise MetraleError(
            f"the cuda backend has no kernels for a {k_cache.dtype}/{v_cache.dtype} KV cache",
            hint="bf16 and fp8 caches are supported here; other dtypes need their own kernels",
        )
    return KV_KERNELS[k_cache.dtype]


def _check_heads(hq: int, hk: int, head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise MetraleError(
            f"paged attention kernels support head_dim {HEAD_DIMS}, not {head_dim}",
            hint="use --backend torch for this model",
        )
    if hk == 0 or hq % hk:
        raise MetraleError(f"{hq} query heads cannot share {hk} KV heads evenly")


class CudaOps:
    """The CUDA backend of the kernel contract (see ``ops.py`` for shapes and dtypes)."""

    name = "cuda"

    def __init__(self, loader: KernelLoader | None = None):
        self.loader = loader or KernelLoader()

    def _launch(self, kernel, grid, block, *args):
        spec, sig = kernel
        self.loader.launch(spec, sig, grid, block, *args)

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

    def reshape_and_cache(self, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
        kernels = _kv_for(k_cache, v_cache)
        tokens, hk, head_dim = k.shape
        if not tokens:
            return
        scales = (k_scale, v_scale) if k_cache.dtype == torch.float8_e4m3fn else ()
        self._launch(
            kernels.cache_write, (tokens,), (128,), _ready(k), _ready(v), k_cache, v_cache,
            _ready(slot_mapping), *scales, hk, head_dim,
        )

    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale):
        kernels = _kv_for(k_cache, v_cache)
        batch, hq, head_dim = q.shape
        hk = k_cache.shape[2]
        _check_heads(hq, hk, head_dim)
        q, out = _ready(q), torch.empty_like(q)
        if not batch:
            return out
        chunks = math.ceil(hq // hk / rows_per_cta(head_dim))
        splits = self._splits(q.device, hk * batch * chunks, block_tables.shape[1])
        part_o = part_ml = None
        if splits > 1:
            part_o = torch.empty(batch, hq, splits, head_dim, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(batch, hq, splits, 2, dtype=torch.float32, device=q.device)
        self._launch(
            kernels.decode, (hk, batch, chunks * splits), (ATTN_THREADS,), q, k_cache, v_cache,
            _ready(block_tables), _ready(seq_lens), out, part_o, part_ml, k_scale, v_scale, scale,
            hq, hk, head_dim, block_tables.shape[1], splits,
        )
        if splits > 1:
            self._launch(kernels.combine, (hq, batch), (128,), part_o, part_ml, out, hq, head_dim, splits)
        return out

    @staticmethod
    def _splits(device: torch.device, ctas: int, max_blocks: int) -> int:
        """Context splits so that the grid covers the GPU twice; static per shape (graph-safe)."""
        by_size = max(1, max_blocks * 16 // MIN_KEYS_PER_SPLIT)
        wanted = math.ceil(2 * _sm_count(device.index) / ctas)
        return max(1, min(MAX_SPLITS, by_size, wanted))

    def paged_prefill(self, q, k_cache, v_cache, block_table, start_pos, scale, k_scale, v_scale):
        kernels = _kv_for(k_cache, v_cache)
        tokens, hq, head_dim = q.shape
        hk = k_cache.shape[2]
        _check_heads(hq, hk, head_dim)
        q, out = _ready(q), torch.empty_like(q)
        if tokens:
            rows = math.ceil(tokens * (hq // hk) / rows_per_cta(head_dim))
            if rows > 65535:
                raise MetraleError(
                    f"prefill chunk of {tokens} tokens is too long for one launch",
                    hint="prefill in chunks of at most 8192 tokens",
                )
            self._launch(
                kernels.prefill, (hk, rows), (ATTN_THREADS,), q, k_cache, v_cache, _ready(block_table),
                out, k_scale, v_scale, scale, tokens, start_pos, hq, hk, head_dim,
            )
        return out


def _norm_block(hidden: int) -> int:
    return 256 if hidden >= 2048 else 128


def layer_kernels(kv_dtype, head_dim: int) -> list[KernelSpec]:
    """Every kernel ``CudaOps`` launches for a model with this KV dtype: the start-up check loads
    them all before any weight is read."""
    from metrale_cli.kv.dtypes import kv_pair
    from metrale_cli.kv.paged import storage_dtype

    if head_dim not in HEAD_DIMS:
        raise MetraleError(
            f"paged attention kernels support head_dim {HEAD_DIMS}, not {head_dim}",
            hint="use --backend torch for this model",
        )
    specs = [RMS_NORM[0], ADD_RMS_NORM[0], ROPE[0], SILU_AND_MUL[0]]
    for side in dict.fromkeys(kv_pair(kv_dtype)):
        kv = KV_KERNELS[storage_dtype(side)]
        specs += [kv.cache_write[0], kv.decode[0], kv.combine[0], kv.prefill[0]]
    return specs
