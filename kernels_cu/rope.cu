// Neox (rotate-half) RoPE in place on q and k, first rot_dim dims of each head. Matches the
// torch reference's rounding (rope.cuh): cos/sin rounded to bf16, each product and the sum
// rounded to bf16.
#include "rope.cuh"

// q: (T, Hq, D), k: (T, Hk, D) bf16; positions: (T,) int32; cos/sin: (max_pos, rot_dim/2) fp32.
// grid = (T, ceil((Hq + Hk) * rot_dim / 2 / blockDim.x)): one thread per rotated pair.
extern "C" __global__ void rope_neox_bf16(bf16_t* q, bf16_t* k, const int* positions,
                                          const float* cos_table, const float* sin_table,
                                          int num_q_heads, int num_kv_heads, int head_dim,
                                          int rot_dim) {
    const int t = blockIdx.x;
    const int half = rot_dim / 2;
    const long long pos = positions[t];
    const float* cos_row = cos_table + pos * half;
    const float* sin_row = sin_table + pos * half;
    const int pairs = (num_q_heads + num_kv_heads) * half;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < pairs) {
        const int head = i / half, j = i - head * half;
        bf16_t* base = head < num_q_heads
                           ? q + ((long long)t * num_q_heads + head) * head_dim
                           : k + ((long long)t * num_kv_heads + (head - num_q_heads)) * head_dim;
        rope_pair(base, j, half, cos_row, sin_row);
    }
}
