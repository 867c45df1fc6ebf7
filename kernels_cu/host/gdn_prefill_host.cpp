// gdn_prefill.cu as a host library, over the grids CudaOps launches, so the tests can hold its
// kernels to the torch forms (gdn_chunked.torch_walk, gdn_reference) on a CPU:
//   g++ -std=c++20 -O1 -ffp-contract=off -fno-gnu-unique -shared -fPIC -I../include gdn_prefill_host.cpp -o gdn_prefill.so
#include "emulate.h"
#include "../gdn_prefill.cu"

extern "C" void host_gdn_chunk_walk(const float* w, float* u, const float* k_tail, const float* gamma, float* state,
                                    float* starts, int pairs, int chunks, int dk, int dv) {
    run_grid((dv + GDN_WALK_COLS - 1) / GDN_WALK_COLS, pairs, GDN_WALK_THREADS,
             [&] { gdn_chunk_walk_f32(w, u, k_tail, gamma, state, starts, chunks, dk, dv); });
}

extern "C" void host_gdn_chunk_prep(float* q, const float* k, const float* v, const float* g, const float* beta,
                                    float* w, float* u, float* k_tail, float* gamma, float* scores, int pairs,
                                    int chunks, int dk, int dv) {
    run_grid(chunks, pairs, GDN_PREP_THREADS,
             [&] { gdn_chunk_prep_f32(q, k, v, g, beta, w, u, k_tail, gamma, scores, chunks, dk, dv); });
}

extern "C" void host_gdn_chunk_inputs(const bf16_t* conv, const bf16_t* b, const bf16_t* a, const float* a_log,
                                      const float* dt_bias, float* q, float* k, float* v, float* g, float* beta,
                                      int tokens, int padded, int conv_stride, int b_stride, int a_stride,
                                      int num_k_heads, int num_v_heads, int dk, int dv, int threads) {
    run_grid(padded, num_v_heads, threads, [&] {
        gdn_chunk_inputs_bf16(conv, b, a, a_log, dt_bias, q, k, v, g, beta, tokens, conv_stride, b_stride, a_stride,
                              num_k_heads, num_v_heads, dk, dv);
    });
}

extern "C" void host_gdn_conv(const bf16_t* mixed, const bf16_t* weight, float* window, bf16_t* out, int tokens,
                              int start_pos, int mixed_stride, int channels, int taps) {
    run_grid((channels + GDN_CONV_THREADS - 1) / GDN_CONV_THREADS, (tokens + GDN_CONV_TOKENS - 1) / GDN_CONV_TOKENS,
             GDN_CONV_THREADS,
             [&] { gdn_conv_bf16(mixed, weight, window, out, tokens, start_pos, mixed_stride, channels, taps); });
}

extern "C" void host_gdn_gated_norm(const float* o, const bf16_t* z, const bf16_t* norm, bf16_t* out, int tokens,
                                    int padded, int z_stride, int num_v_heads, int dv, float eps) {
    run_grid(tokens, num_v_heads, 32 * ((dv + 31) / 32),
             [&] { gdn_gated_norm_bf16(o, z, norm, out, padded, z_stride, num_v_heads, dv, eps); });
}
