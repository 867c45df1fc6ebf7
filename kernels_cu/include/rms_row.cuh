// The arithmetic of RMSNorm over one row, HF rounding order: r = 1 / sqrt(mean(x^2) + eps),
// y = bf16(x * r), out = bf16(w * y). Shared by rmsnorm.cu (a block per row) and
// rope_and_cache.cu (a warp per head), which must round a head's row identically.
// The sum of squares is spelled with explicit fused multiply-adds: rmsnorm.cu (compiled with
// FMA contraction) and the --fmad=false modules then compute the very same sums.
#pragma once
#include "numeric.cuh"

// ss + f[0]^2 + ... + f[V-1]^2, accumulated in that order.
template <int V>
__device__ __forceinline__ float add_squares(float ss, const float* f) {
#pragma unroll
    for (int j = 0; j < V; ++j) ss = __fmaf_rn(f[j], f[j], ss);
    return ss;
}

__device__ __forceinline__ float inv_rms(float sum_squares, int hidden, float eps) {
    return 1.0f / sqrtf(sum_squares / (float)hidden + eps);
}

// One normalized element before its bf16 store: w * bf16(x * r) (two products that no
// contraction can touch: each result is rounded or stored).
__device__ __forceinline__ float rms_scaled(float x, float w, float r) { return w * round_bf16(x * r); }
