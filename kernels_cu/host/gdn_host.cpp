// gdn.cu's decode kernels as a host library, over the grid CudaOps launches (Hv x rows CTAs of
// `threads`), its parameters in the kernel's order, so the tests can run CudaOps.gdn_decode's
// launch on a CPU and hold the conv window, the rule's state and the gated norm to
// gdn_reference.decode step after step:
//   g++ -std=c++20 -O1 -ffp-contract=off -fno-gnu-unique -shared -fPIC -I../include gdn_host.cpp -o gdn.so
#include "emulate.h"
#include "../gdn.cu"

extern "C" void host_gdn_decode(const bf16_t* mixed, const bf16_t* z, const bf16_t* b, const bf16_t* a,
                                const bf16_t* conv, const float* a_log, const float* dt_bias, const bf16_t* norm,
                                float* conv_pool, float* state_pool, const int* slots, const int* positions,
                                bf16_t* out, int mixed_stride, int z_stride, int b_stride, int a_stride,
                                int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim, int taps, float eps,
                                int rows, int threads) {
    run_grid(num_v_heads, rows, threads, [&] {
        gdn_decode_bf16(mixed, z, b, a, conv, a_log, dt_bias, norm, conv_pool, state_pool, slots, positions, out,
                        mixed_stride, z_stride, b_stride, a_stride, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                        taps, eps);
    });
}

extern "C" void host_gdn_decode_one(const bf16_t* mixed, const bf16_t* z, const bf16_t* b, const bf16_t* a,
                                    const bf16_t* conv, const float* a_log, const float* dt_bias, const bf16_t* norm,
                                    float* conv_pool, float* state_pool, const int* slots, const int* positions,
                                    bf16_t* out, int mixed_stride, int z_stride, int b_stride, int a_stride,
                                    int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim, int taps,
                                    float eps, int rows, int threads) {
    run_grid(num_v_heads, rows, threads, [&] {
        gdn_decode_one_bf16(mixed, z, b, a, conv, a_log, dt_bias, norm, conv_pool, state_pool, slots, positions, out,
                            mixed_stride, z_stride, b_stride, a_stride, num_k_heads, num_v_heads, head_k_dim,
                            head_v_dim, taps, eps);
    });
}
