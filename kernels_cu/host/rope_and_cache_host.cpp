// The fused rope_and_cache_<dtype> kernels and the unfused kernels they replace (rms_norm_bf16,
// rope_neox_bf16) as a host library, so tests can check on a CPU that the fused kernel gives the
// bytes of the unfused sequence (whose cache write kv_codec_host.cpp checks against the codecs):
//   g++ -std=c++20 -O1 -ffp-contract=off -fno-gnu-unique -shared -fPIC -I../include rope_and_cache_host.cpp -o rc.so
#include "emulate.h"
#include "../rmsnorm.cu"
#include "../rope.cu"
#include "../rope_and_cache.cu"

namespace {

typedef void (*FusedEntry)(const bf16_t*, const bf16_t*, const bf16_t*, bf16_t*, void*, void*, const int*,
                           const int*, const float*, const float*, const bf16_t*, const bf16_t*,
                           const float*, const float*, const float*, const float*, const float*, int,
                           int, int, int, int, int, int, float, int);

// In KvCacheDtype order (kv/dtypes.py).
const FusedEntry kFused[] = {
    rope_and_cache_bf16, rope_and_cache_fp8, rope_and_cache_nvfp4, rope_and_cache_turbo4,
    rope_and_cache_turbo3, rope_and_cache_turbo2, rope_and_cache_turbo8,
    rope_and_cache_turbo4k_turbo3v, rope_and_cache_turbo4k_turbo8v, rope_and_cache_turbo3k_turbo8v,
    rope_and_cache_bf16k_turbo4v, rope_and_cache_bf16k_turbo3v, rope_and_cache_bf16k_turbo2v,
    rope_and_cache_fp8k_turbo4v, rope_and_cache_fp8k_turbo3v, rope_and_cache_fp8k_turbo2v,
};

}  // namespace

// rms_norm_bf16 over `rows` rows of `hidden`, a 128-thread block per row (CudaOps' launch).
extern "C" void host_rms_norm(const bf16_t* x, const bf16_t* w, bf16_t* out, int rows, int hidden,
                              float eps) {
    for (int r = 0; r < rows; ++r)
        run_block({(unsigned)r, 0, 0}, 128, [&] { rms_norm_bf16(x, w, out, hidden, eps); });
}

// rope_neox_bf16 in place on contiguous q (T, Hq, D), k (T, Hk, D), as CudaOps launches it.
extern "C" void host_rope(bf16_t* q, bf16_t* k, const int* positions, const float* cos_table,
                          const float* sin_table, int tokens, int hq, int hk, int head_dim, int rot_dim) {
    const int blocks = ((hq + hk) * (rot_dim / 2) + 127) / 128;
    for (int t = 0; t < tokens; ++t)
        for (int b = 0; b < blocks; ++b)
            run_block({(unsigned)t, (unsigned)b, 0}, 128, [&] {
                rope_neox_bf16(q, k, positions, cos_table, sin_table, hq, hk, head_dim, rot_dim);
            });
}

// rope_and_cache_<dtype> (dtype: the index in KvCacheDtype) over its whole grid. 0 on success.
extern "C" int host_rope_and_cache(int dtype, int tokens, const bf16_t* q, const bf16_t* k, const bf16_t* v,
                                   bf16_t* q_out, void* k_cache, void* v_cache, const int* slot_mapping,
                                   const int* positions, const float* cos_table, const float* sin_table,
                                   const bf16_t* q_norm, const bf16_t* k_norm, const float* k_scale,
                                   const float* v_scale, const float* k_signs, const float* v_signs,
                                   const float* channel_scale, int q_stride, int k_stride, int v_stride,
                                   int hq, int hk, int head_dim, int rot_dim, float eps, int rotate_q) {
    if (dtype < 0 || dtype >= (int)(sizeof(kFused) / sizeof(kFused[0]))) return 1;
    const int ys = hk + (hq + ROPE_CACHE_WARPS - 1) / ROPE_CACHE_WARPS;
    for (int t = 0; t < tokens; ++t)
        for (int y = 0; y < ys; ++y)
            run_block({(unsigned)t, (unsigned)y, 0}, 32 * ROPE_CACHE_WARPS, [&] {
                kFused[dtype](q, k, v, q_out, k_cache, v_cache, slot_mapping, positions, cos_table, sin_table,
                              q_norm, k_norm, k_scale, v_scale, k_signs, v_signs, channel_scale, q_stride,
                              k_stride, v_stride, hq, hk, head_dim, rot_dim, eps, rotate_q);
            });
    return 0;
}

// The sum of squares the norm divides by, per row of `hidden` (64 .. 512): rmsnorm.cu's
// (block = 0: a 128-thread block, as CudaOps launches it) or rope_and_cache.cu's (block = 1: one
// warp). out: (rows,) fp32. 0 on success.
extern "C" int host_sum_squares(int block, const bf16_t* x, int rows, int hidden, float* out) {
    for (int r = 0; r < rows; ++r) {
        const bf16_t* row = x + (long long)r * hidden;
        if (block == 0) {
            run_block({0, 0, 0}, 128, [&] {
                const float ss = row_sum_squares<8>(row, hidden);
                if (threadIdx.x == 0) out[r] = ss;
            });
            continue;
        }
        run_warp([&] {
            float f[2][8];
            float ss = 0.0f;
            switch (hidden) {
                case 64: load_head<64>(row, f); ss = head_sum_squares<64>(f); break;
                case 128: load_head<128>(row, f); ss = head_sum_squares<128>(f); break;
                case 256: load_head<256>(row, f); ss = head_sum_squares<256>(f); break;
                case 512: load_head<512>(row, f); ss = head_sum_squares<512>(f); break;
            }
            if (threadIdx.x == 0) out[r] = ss;
        });
    }
    return hidden == 64 || hidden == 128 || hidden == 256 || hidden == 512 ? 0 : 1;
}
