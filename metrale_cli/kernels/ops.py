"""The kernel contract every backend implements.

Two backends implement :class:`Ops`: ``TorchOps`` (``kernels/reference.py``, plain torch, the
oracle) and ``CudaOps`` (``kernels/cuda_ops.py``, CuPy-compiled kernels from ``kernels_cu/``).
The model picks one at build time and never per call. Dense GEMMs and embeddings are not part of
the contract: both backends use torch (cuBLAS on a GPU) for them.

Shapes below use T = tokens, B = sequences, Hq / Hk = query / KV heads, D = head_dim,
NB = blocks in the pool, MB = blocks in a block table. Activations are bf16 (or the model dtype);
``positions``, ``slot_mapping``, ``block_tables`` and ``seq_lens`` are int32 on the activations'
device. KV scales are float32 tensors of shape (1,) on that device so a CUDA graph can capture
them (online fp8 calibration rewrites them in place).

Paged KV layout (per layer, per side): ``(NB, BLOCK_SIZE, Hk, D)``; element dtype bf16 for a
bf16 side, ``torch.float8_e4m3fn`` for an fp8 side (stored value = e4m3(x / scale), rounded to
nearest even with saturation to ±448). Slot ``s`` is block ``s // 16``, offset ``s % 16``;
a negative slot is skipped.
"""

from __future__ import annotations

from typing import Protocol

import torch

BLOCK_SIZE = 16


class Ops(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: (T, H), weight: (H,) -> (T, H) in x's dtype. HF convention: w * (x·rsqrt(mean x²+eps))."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused residual add: s = x + residual (rounded to x's dtype) -> (rms_norm(s), s)."""

    def rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style (rotate-half) RoPE on the first ``rot_dim`` dims of each head.

        q: (T, Hq, D), k: (T, Hk, D), positions: (T,) int32, cos/sin: (max_pos, rot_dim // 2)
        float32 tables. May work in place; callers use the returned tensors.
        """

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: (T, 2I) = [gate | up] -> silu(gate) * up: (T, I)."""

    def reshape_and_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> None:
        """Write k, v: (T, Hk, D) into the paged caches at ``slot_mapping``: (T,).

        The cache tensors' dtype selects the store (bf16 copy or fp8 quantize by scale).
        """

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> torch.Tensor:
        """One query token per sequence over its whole cached context.

        q: (B, Hq, D), block_tables: (B, MB), seq_lens: (B,) tokens in the cache for each
        sequence, the current one included -> (B, Hq, D) in q's dtype. GQA: query head h reads
        KV head h // (Hq // Hk).
        """

    def paged_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        start_pos: int,
        scale: float,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> torch.Tensor:
        """Causal attention of one chunk of one sequence over the cache (chunked prefill).

        q: (T, Hq, D) holds positions ``start_pos .. start_pos+T-1``, whose K/V are already in
        the cache together with every earlier position; block_table: (MB,). Query t attends to
        cache positions ``0 .. start_pos + t`` -> (T, Hq, D) in q's dtype.
        """
