// paged_decode_attn, paged_decode_combine and attn_prefill_paged of one (K side, V side) pair as a
// host library, launched over their whole grids as CudaOps launches them, so tests can check the
// attention body (key batches, the transposed reduction, splits and their combine, the online
// softmax) against the torch references on a CPU. The sides come from -D defines, as in the
// registry's modules:
//   g++ -std=c++20 -O1 -ffp-contract=off -fno-gnu-unique -shared -fPIC -I../include -DK_SIDE=fp8 -DV_SIDE=turbo4 \
//       paged_attention_host.cpp -o pa.so
#include "emulate.h"
#include "../paged_decode.cu"
#include "../prefill_paged.cu"
#include "decode_grid.h"

// grid = (hk, batch, chunks * num_splits), then the combine over (hq, batch) when split, which
// rotates the output back by v_signs when they are given.
extern "C" void host_paged_decode(const bf16_t* q, const void* k_cache, const void* v_cache,
                                  const int* block_tables, const int* seq_lens, bf16_t* out,
                                  float* part_o, float* part_ml, const float* k_scale,
                                  const float* v_scale, float scale, int hq, int hk, int head_dim,
                                  int max_blocks, int num_splits, int batch, int chunks, const float* v_signs) {
    run_paged_decode(hk, batch, chunks * num_splits, ATTN_THREADS, [&] {
        paged_decode_attn(q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_ml, k_scale, v_scale,
                          scale, hq, hk, head_dim, max_blocks, num_splits);
    }, part_o, part_ml, seq_lens, out, hq, head_dim, num_splits, v_signs);
}

// grid = (hk, rows): rows of RowsPerCta<D> (token, query head) pairs.
extern "C" void host_paged_prefill(const bf16_t* q, const void* k_cache, const void* v_cache,
                                   const int* block_table, bf16_t* out, const float* k_scale,
                                   const float* v_scale, float scale, int tokens, int start_pos, int hq,
                                   int hk, int head_dim, int rows) {
    for (int y = 0; y < rows; ++y)
        for (int x = 0; x < hk; ++x)
            run_block({(unsigned)x, (unsigned)y, 0}, ATTN_THREADS, [&] {
                attn_prefill_paged(q, k_cache, v_cache, block_table, out, k_scale, v_scale, scale, tokens,
                                   start_pos, hq, hk, head_dim);
            });
}
