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
