// The WHT bookends of rotated KV sides: rotate bf16 rows in place by R = S2 H S1 / sqrt(D)
// (wht_bf16_inplace: Q before attention when K is rotated) or by R^T (wht_bf16_inplace_inv:
// the attention output when V is rotated). fp32 inside, rounded to bf16 once, in the order of
// docs/kv-formats.md (wht.cuh). Compiled with --fmad=false. Launched programmatically (pdl.cuh).
#include "numeric.cuh"
#include "pdl.cuh"
#include "wht.cuh"

#define WHT_WARPS 4

__device__ void rotate_rows(bf16_t* x, const float* first, const float* last, int rows, int head_dim) {
    __shared__ float scratch[WHT_WARPS][512];
    const int warp = threadIdx.x >> 5;
    const long long row = (long long)blockIdx.x * WHT_WARPS + warp;
    pdl_wait();
    pdl_launch_dependents();
    if (row >= rows) return;
    bf16_t* r = x + row * head_dim;
    switch (head_dim) {
        case 64: wht_rotate_row<64>(r, first, last, scratch[warp]); break;
        case 128: wht_rotate_row<128>(r, first, last, scratch[warp]); break;
        case 256: wht_rotate_row<256>(r, first, last, scratch[warp]); break;
        case 512: wht_rotate_row<512>(r, first, last, scratch[warp]); break;
    }
}

// x: (rows, D) bf16, rotated in place; signs: (2, D) fp32 (row 0 = S1, row 1 = S2).
// grid = ceil(rows / 4), block = 128 (a warp per row). head_dim: 64, 128, 256 or 512.
extern "C" __global__ void __launch_bounds__(WHT_WARPS * 32)
    wht_bf16_inplace(bf16_t* x, const float* signs, int rows, int head_dim) {
    rotate_rows(x, signs, signs + head_dim, rows, head_dim);
}

extern "C" __global__ void __launch_bounds__(WHT_WARPS * 32)
    wht_bf16_inplace_inv(bf16_t* x, const float* signs, int rows, int head_dim) {
    rotate_rows(x, signs + head_dim, signs, rows, head_dim);
}
