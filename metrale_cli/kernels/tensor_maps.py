"""2-D tensor maps (TMA descriptors) of bf16 matrices for gemm_rows.cu, built with cuda-bindings.

A map holds an address, a shape and a stride, not the tensor: a weight's map is built once and
kept; an activation's is kept by address and shape, which a CUDA graph's static buffers and the
caching allocator's reuse make the common case. The maps read 64 x ``box_rows`` boxes, 128-byte
swizzled (the kernel's shared-memory layout), rows past the matrix as zeros.
"""

from __future__ import annotations

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.loader import _pdl_driver

_MAPS: dict[tuple[int, int, int, int, int], object] = {}
_MAX_MAPS = 4096  # beyond this many (a process that allocates without end), start over


def available() -> bool:
    """Whether tensor maps can be built here (cuda-bindings is installed)."""
    return _pdl_driver() is not None


def bf16_map(t: torch.Tensor, box_rows: int):
    """The map of ``t`` (rows, cols) bf16, contiguous, 16-byte aligned, cols % 8 == 0."""
    driver = _pdl_driver()
    rows, cols = t.shape
    key = (t.device.index, t.data_ptr(), rows, cols, box_rows)
    have = _MAPS.get(key)
    if have is not None:
        return have
    if len(_MAPS) >= _MAX_MAPS:
        _MAPS.clear()
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.data_ptr(), [u64(cols), u64(rows)],
        [u64(cols * 2)], [u32(64), u32(box_rows)], [u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise MetraleError(f"cuTensorMapEncodeTiled failed for a ({rows}, {cols}) bf16 matrix: {err.name}",
                           hint="the projection needs a contiguous, 16-byte aligned bf16 weight")
    _MAPS[key] = tmap
    return tmap
