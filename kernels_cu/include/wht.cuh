// The randomized Walsh-Hadamard rotation R = S2 H S1 / sqrt(D) of one vector, by one warp, in
// fp32 in shared memory, in exactly the order of docs/kv-formats.md ("Rotation"): sign flip,
// butterflies for h = 1, 2, ..., D/2, then (y * S2) * c with c = fp32(1 / sqrt(D)). Every
// butterfly output is one IEEE add, so the lanes' split of the pairs does not change a bit.
// The inverse R^T swaps S1 and S2. Every step is an _rn intrinsic, so no FMA contraction can
// change a bit, whatever the module's --fmad.
#pragma once
#include "numeric.cuh"

template <int D>
__device__ __forceinline__ float wht_norm() {
    // fp32(1 / sqrt(D)) as the torch reference rounds it from a double
    return D == 64 ? 0.125f : D == 128 ? (float)0.08838834764831845 : D == 256 ? 0.0625f
                                                                              : (float)0.044194173824159216;
}

// y: this warp's D floats in shared memory. first / last: the sign rows applied before the
// butterflies and after them (S1, S2 forward; S2, S1 inverse).
template <int D>
__device__ void wht_rotate(float* y, const float* first, const float* last) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < D; i += 32) y[i] = __fmul_rn(y[i], first[i]);
    __syncwarp();
    for (int h = 1; h < D; h <<= 1) {
        for (int p = lane; p < D / 2; p += 32) {
            const int i = (p / h) * 2 * h + p % h;  // the pair (i, i + h) with i & h == 0
            const float a = y[i], b = y[i + h];
            y[i] = __fadd_rn(a, b);
            y[i + h] = __fsub_rn(a, b);
        }
        __syncwarp();
    }
    const float c = wht_norm<D>();
    for (int i = lane; i < D; i += 32) y[i] = __fmul_rn(__fmul_rn(y[i], last[i]), c);
    __syncwarp();
}

// A bf16 row of D elements rotated in place, as wht_bf16_inplace stores it: widened to fp32 in y
// (the warp's D floats of shared scratch), wht_rotate, rounded to bf16 once.
template <int D>
__device__ void wht_rotate_row(bf16_t* row, const float* first, const float* last, float* y) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < D; i += 32) y[i] = bf16_to_f32(row[i]);
    __syncwarp();
    wht_rotate<D>(y, first, last);
    for (int i = lane; i < D; i += 32) row[i] = f32_to_bf16(y[i]);
    __syncwarp();
}
