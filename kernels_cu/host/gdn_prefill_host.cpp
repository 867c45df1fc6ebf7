// gdn_prefill.cu's walk as a host library, over the grid CudaOps launches, so the tests can hold it
// to gdn_chunked.torch_walk on a CPU:
//   g++ -std=c++20 -O1 -ffp-contract=off -shared -fPIC -I../include gdn_prefill_host.cpp -o gdn_prefill.so
#include "emulate.h"
#include "../gdn_prefill.cu"

extern "C" void host_gdn_chunk_walk(const float* w, float* u, const float* k_tail, const float* gamma, float* state,
                                    float* starts, int pairs, int chunks, int dk, int dv) {
    run_grid((dv + GDN_WALK_COLS - 1) / GDN_WALK_COLS, pairs, GDN_WALK_THREADS,
             [&] { gdn_chunk_walk_f32(w, u, k_tail, gamma, state, starts, chunks, dk, dv); });
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
