// Neox (rotate-half) RoPE of one pair of a head, in place, with the torch reference's rounding:
// cos/sin rounded to bf16, each product and the sum rounded to bf16. Shared by rope.cu and
// rope_and_cache.cu.
#pragma once
#include "numeric.cuh"

// Pair (j, j + half) of `head` (global or shared memory) at the angle of cos_row[j], sin_row[j].
__device__ __forceinline__ void rope_pair(bf16_t* head, int j, int half, const float* cos_row,
                                          const float* sin_row) {
    const float c = round_bf16(cos_row[j]), s = round_bf16(sin_row[j]);
    const float x1 = bf16_to_f32(head[j]);
    const float x2 = bf16_to_f32(head[j + half]);
    head[j] = f32_to_bf16(round_bf16(x1 * c) + round_bf16(-x2 * s));
    head[j + half] = f32_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
}
