"""The cuda backend's Gated DeltaNet mixer (:meth:`~metrale_cli.kernels.ops.Ops.gdn_decode`).

A decode step is one launch of gdn.cu: a CTA per (value head, row) runs the conv over the slot's
window, the gated delta rule over the slot's state and the gated norm, reading each row's slot and
position on the device, so it neither syncs with the host nor allocates anything but its output,
and a CUDA graph captures it. The four inputs are read in place when they are rows of one
projection (the layer's split), copied only when misaligned. Prefill is the chunked form of
``gdn_chunked``: gdn_prefill.cu's conv over the slot's window, its launch for the rule's inputs,
its launch for every chunk's own part, its walk over the chunks, two batched GEMMs for the
outputs and its gated norm.
"""

from __future__ import annotations

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import gdn_chunked
from metrale_cli.kernels.cuda_launch import CudaLauncher, _head_rows, _ready
from metrale_cli.kernels.ops import GdnTensors
from metrale_cli.kernels.registry import GDN_HEAD_K_DIMS
from metrale_cli.kernels.table import (
    GDN_CHUNK_INPUTS, GDN_CHUNK_PREP, GDN_CHUNK_WALK, GDN_CONV, GDN_CONV_THREADS, GDN_CONV_TOKENS, GDN_DECODE,
    GDN_DECODE_ONE, GDN_GATED_NORM, GDN_MAX_DV, GDN_MAX_TAPS, GDN_ONE_MAX_TAPS, GDN_ONE_THREADS, GDN_PREP_MAX_DV,
    GDN_PREP_THREADS, GDN_WALK_COLS, GDN_WALK_MAX_DK, GDN_WALK_THREADS, gdn_prep_shared_bytes, gdn_threads,
)

# Whether a one-row launch takes gdn_decode_one_bf16 where it serves the shape (False: never; an
# A/B switch for the benches and the tests).
GDN_ONE = True


def gdn_decode_kernel(rows: int, dk: int, dv: int, taps: int):
    """Batch 1's entry (one row; its pool reads before the PDL wait) where it serves the shape, else
    the general one: the same outputs and pools."""
    threads = gdn_threads(dv)
    one = GDN_ONE and rows == 1 and 2 * dk <= threads <= GDN_ONE_THREADS and taps <= GDN_ONE_MAX_TAPS
    return GDN_DECODE_ONE if one else GDN_DECODE


def check_gdn_shapes(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                     layer: GdnTensors) -> None:
    """What gdn_decode_bf16 serves: bf16 activations and weights, fp32 parameters and contiguous
    fp32 pools (updated in place: never a copy), Dk of its instantiations, Dv up to a CTA."""
    hv, dk, dv = layer.recurrent_pool.shape[1:]
    hk, rows = layer.num_k_heads, mixed.shape[0]
    if any(t.dtype != torch.bfloat16 for t in (mixed, z, b, a, layer.conv, layer.norm)):
        raise MetraleError(f"the cuda backend's Gated DeltaNet decode takes bf16 activations and weights, not "
                           f"{mixed.dtype} / {layer.conv.dtype}", hint="load the model in bf16, or use --backend torch")
    if mixed.shape != (rows, layer.conv.shape[0]) or z.shape != (rows, hv * dv) or b.shape != (rows, hv) \
            or a.shape != (rows, hv):
        raise MetraleError(f"gdn_decode takes mixed (B, C), z (B, Hv*Dv), b / a (B, Hv) for C = {layer.conv.shape[0]}, "
                           f"Hv = {hv}, Dv = {dv}, not {[tuple(t.shape) for t in (mixed, z, b, a)]}")
    pools = (layer.a_log, layer.dt_bias, layer.conv_pool, layer.recurrent_pool)
    if any(t.dtype != torch.float32 for t in pools) or not all(t.is_contiguous() for t in pools[2:]):
        raise MetraleError("the cuda backend's Gated DeltaNet decode takes float32 A_log / dt_bias and contiguous "
                           "float32 state pools", hint="allocate the pools as SsmStatePool does")
    if dk not in GDN_HEAD_K_DIMS or not 0 < dv <= GDN_MAX_DV or hk <= 0 or hv % hk \
            or layer.conv.shape[0] != 2 * hk * dk + hv * dv:
        raise MetraleError(f"the cuda backend's Gated DeltaNet decode serves key head dims {GDN_HEAD_K_DIMS}, value "
                           f"head dims up to {GDN_MAX_DV} and value heads a multiple of the key heads, not "
                           f"{hk} x {dk} key and {hv} x {dv} value heads", hint="use --backend torch")


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B, n) rows with unit column stride -> (what the kernel reads, the row stride)."""
    return _head_rows(x[:, None])


class CudaGdn:
    """The Gated DeltaNet part of ``CudaOps`` (mixed into it)."""

    def gdn_decode(self: CudaLauncher, mixed, z, b, a, layer: GdnTensors, slots, positions):
        check_gdn_shapes(mixed, z, b, a, layer)
        rows = mixed.shape[0]
        hv, dk, dv = layer.recurrent_pool.shape[1:]
        out = torch.empty(rows, hv * dv, dtype=mixed.dtype, device=mixed.device)
        if rows:
            (m, m_stride), (zs, z_stride), (bs, b_stride), (as_, a_stride) = (_rows(t) for t in (mixed, z, b, a))
            kernel = gdn_decode_kernel(rows, dk, dv, layer.conv.shape[1])
            self._launch(kernel, (hv, rows), (gdn_threads(dv),), m, zs, bs, as_, _ready(layer.conv),
                         _ready(layer.a_log), _ready(layer.dt_bias), _ready(layer.norm), layer.conv_pool,
                         layer.recurrent_pool, _ready(slots), _ready(positions), out, m_stride, z_stride, b_stride,
                         a_stride, layer.num_k_heads, hv, dk, dv, layer.conv.shape[1], layer.eps, pdl=True)
        return out

    def gdn_prefill(self, mixed, z, b, a, layer: GdnTensors, slot: int, start_pos: int):
        """The chunked form (``gdn_chunked``): every chunk's own part in one launch of gdn_prefill.cu,
        the walk over the chunks in another, the outputs as two batched GEMMs."""
        hv, dk, dv = layer.recurrent_pool.shape[1:]
        if dk > GDN_WALK_MAX_DK or dk % 4:
            raise MetraleError(f"the cuda backend's Gated DeltaNet prefill serves key head dims that are multiples "
                               f"of 4 up to {GDN_WALK_MAX_DK}, not {dk}", hint="use --backend torch")
        max_dv = min(GDN_WALK_THREADS, GDN_PREP_MAX_DV)
        if dv > max_dv or dv % 4 or mixed.dtype != torch.bfloat16:
            raise MetraleError(f"the cuda backend's Gated DeltaNet prefill takes bf16 activations and value head dims "
                               f"that are multiples of 4 up to {max_dv}, not {mixed.dtype} and {dv}",
                               hint="use --backend torch")
        channels, taps = layer.conv.shape
        if not 0 < taps <= GDN_MAX_TAPS or layer.conv_pool.dtype != torch.float32 \
                or not layer.conv_pool.is_contiguous():
            raise MetraleError(f"the cuda backend's Gated DeltaNet prefill serves convs of up to {GDN_MAX_TAPS} taps "
                               f"over a contiguous fp32 window pool, not {taps}", hint="use --backend torch")
        tokens = mixed.shape[0]
        conv = torch.empty(tokens, channels, dtype=mixed.dtype, device=mixed.device)
        if tokens:
            m, m_stride = _rows(mixed)
            self._launch(GDN_CONV, (-(-channels // GDN_CONV_THREADS), -(-tokens // GDN_CONV_TOKENS)),
                         (GDN_CONV_THREADS,), m, _ready(layer.conv), layer.conv_pool[slot], conv, tokens, start_pos,
                         m_stride, channels, taps)
        return self._gdn_chunked(conv, z, b, a, layer, layer.recurrent_pool[slot : slot + 1])

    def _gdn_chunked(self: CudaLauncher, conv, z, b, a, layer: GdnTensors, state):
        """After the conv: the rule's inputs in one launch, gdn_chunked's batched chunks and walk,
        the gated norm in one launch -> (T, Hv*Dv), as ``gdn_reference.mix``."""
        tokens = conv.shape[0]
        hv, dk, dv = state.shape[1:]
        if not tokens:
            return torch.empty(0, hv * dv, dtype=conv.dtype, device=conv.device)
        padded = -(-tokens // gdn_chunked.CHUNK) * gdn_chunked.CHUNK
        f32 = dict(dtype=torch.float32, device=conv.device)
        q, k = torch.empty(hv, padded, dk, **f32), torch.empty(hv, padded, dk, **f32)
        v, g, beta = torch.empty(hv, padded, dv, **f32), torch.empty(hv, padded, **f32), torch.empty(hv, padded, **f32)
        (c, c_stride), (bs, b_stride), (as_, a_stride) = (_rows(t) for t in (conv, b, a))
        self._launch(GDN_CHUNK_INPUTS, (padded, hv), (32 * -(-max(dk, dv) // 32),), c, bs, as_, _ready(layer.a_log),
                     _ready(layer.dt_bias), q, k, v, g, beta, tokens, c_stride, b_stride, a_stride, layer.num_k_heads,
                     hv, dk, dv)
        o = gdn_chunked.chunks(q, k, v, g, beta, state.view(hv, dk, dv), walk=self._gdn_walk, prep=self._gdn_prep)
        out = torch.empty(tokens, hv * dv, dtype=conv.dtype, device=conv.device)
        zs, z_stride = _rows(z)
        self._launch(GDN_GATED_NORM, (tokens, hv), (32 * -(-dv // 32),), o, zs, _ready(layer.norm), out, padded,
                     z_stride, hv, dv, layer.eps)
        return out

    def _gdn_prep(self: CudaLauncher, q, k, v, g, beta):
        """``gdn_chunked.torch_prep``'s contract, one launch (q, k, v, g, beta contiguous fp32; q
        is scaled in place and returned as the last output)."""
        pairs, n, chunk, dk = q.shape
        dv = v.shape[-1]
        f32 = dict(dtype=torch.float32, device=q.device)
        w, u = torch.empty(pairs, n, chunk, dk, **f32), torch.empty(pairs, n, chunk, dv, **f32)
        k_tail, gamma = torch.empty(pairs, n, dk, chunk, **f32), torch.empty(pairs, n, **f32)
        scores = torch.empty(pairs, n, chunk, chunk, **f32)
        self._launch(GDN_CHUNK_PREP, (n, pairs), (GDN_PREP_THREADS,), q, k, v, g, beta, w, u, k_tail, gamma, scores,
                     n, dk, dv, shared_mem=gdn_prep_shared_bytes(dk, dv, chunk))
        return w, u, k_tail, gamma, scores, q

    def _gdn_walk(self: CudaLauncher, w, u, k_tail, gamma, state, starts) -> None:
        """``gdn_chunked.torch_walk``'s contract, one launch (all tensors contiguous fp32)."""
        pairs, chunks, _, dk = w.shape
        dv = u.shape[-1]
        self._launch(GDN_CHUNK_WALK, (-(-dv // GDN_WALK_COLS), pairs), (GDN_WALK_THREADS,), w, u, k_tail, gamma,
                     state, starts, chunks, dk, dv)
