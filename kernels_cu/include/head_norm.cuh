// QK-norm and RoPE of one head row by one warp, rounded exactly as rmsnorm.cu + rope.cu:
// shared by rope_and_cache.cu and decode_stack.cu.
#pragma once
#include "reduce.cuh"
#include "rms_row.cuh"
#include "rope.cuh"

// The 8 elements of chunk c of a head row (16-byte aligned or not: the same values).
__device__ __forceinline__ void load_chunk(const bf16_t* x, bool aligned, float* f) {
    if (aligned) {
        load_vec<8>(x, f);
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = bf16_to_f32(x[j]);
    }
}

// Sum of squares of a row of D elements by one warp, rounded exactly as rmsnorm.cu's 128-thread
// block on that row: thread i of the block sums chunk i (elements 8i .. 8i+7) in order, each
// warp reduces its threads with warp_sum, and the block adds the warps' sums (warps 0 and 1 hold
// chunks 0-31 and 32-63; the others add zeros). Here lane i holds chunks i and 32 + i.
template <int D>
__device__ __forceinline__ float head_sum_squares(const float (*f)[8]) {
    constexpr int CHUNKS = D / 8, ROUNDS = (CHUNKS + 31) / 32;
    const int lane = threadIdx.x & 31;
    float ss = 0.0f;
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const float part = warp_sum(lane + 32 * r < CHUNKS ? add_squares<8>(0.0f, f[r]) : 0.0f);
        ss = r == 0 ? part : __fadd_rn(ss, part);
    }
    return ss;
}

// Lane l loads chunks l and 32 + l (those that exist) of a head row x (D bf16).
template <int D>
__device__ __forceinline__ void load_head(const bf16_t* x, float (*f)[8]) {
    constexpr int CHUNKS = D / 8, ROUNDS = (CHUNKS + 31) / 32;
    const int lane = threadIdx.x & 31;
    const bool aligned = aligned16(x);
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int c = lane + 32 * r;
        if (c < CHUNKS) load_chunk(x + 8 * c, aligned, f[r]);
    }
}

// x (D bf16, global) -> row (shared): RMS-normalized by w (when w is set, else copied), then
// RoPE on its first 2 * half dims at the angle of cos_row / sin_row.
template <int D>
__device__ void norm_rope(const bf16_t* x, const bf16_t* w, float eps, const float* cos_row,
                          const float* sin_row, int half, bf16_t* row) {
    constexpr int CHUNKS = D / 8, ROUNDS = (CHUNKS + 31) / 32;
    const int lane = threadIdx.x & 31;
    float f[ROUNDS][8];
    load_head<D>(x, f);
    const float inv = w == nullptr ? 0.0f : inv_rms(head_sum_squares<D>(f), D, eps);
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int c = lane + 32 * r;
        if (c >= CHUNKS) continue;
        float g[8];
        if (w != nullptr) load_chunk(w + 8 * c, aligned16(w), g);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            row[8 * c + j] = f32_to_bf16(w == nullptr ? f[r][j] : rms_scaled(f[r][j], g[j], inv));
        }
    }
    __syncwarp();
    for (int j = lane; j < half; j += 32) rope_pair(row, j, half, cos_row, sin_row);
    __syncwarp();
}

template <int D>
__device__ void store_row(const bf16_t* row, bf16_t* out) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < D; i += 32) out[i] = row[i];
}
