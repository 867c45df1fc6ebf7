// paged_decode_attn_tc<suffix> (paged_decode_tc.cu, every KV dtype) and the split combine, and
// paged_decode_rope_tc<suffix> (the decode attention in one launch), as a host library, launched over their whole grids as CudaOps launches them, so tests can check the
// tensor-core decode (fragment layouts, the permuted head_dim, movmatrix transposes, query chunks,
// the online softmax and its warp merge) against the torch reference on a CPU:
//   g++ -std=c++20 -O1 -ffp-contract=off -fno-gnu-unique -shared -fPIC -I../include paged_decode_tc_host.cpp -o tc.so
#include "emulate.h"
#include "../paged_decode.cu"
#include "../paged_decode_tc.cu"
#include "decode_grid.h"

typedef void (*TcDecode)(const bf16_t*, const void*, const void*, const int*, const int*, bf16_t*, float*, float*,
                         const float*, const float*, float, int, int, int, int, int, unsigned*, const float*);

// The entry point named paged_decode_attn_tc<suffix> (suffix "" for bf16, else "_<dtype>", or
// "_pair_<dtype>" for a batch-1 pair entry).
static TcDecode tc_entry(const char* suffix) {
#define METRALE_TC(sfx) {#sfx, paged_decode_attn_tc##sfx}
    static const struct {
        const char* suffix;
        TcDecode fn;
    } entries[] = {METRALE_TC(), METRALE_TC(_fp8), METRALE_TC(_nvfp4), METRALE_TC(_turbo4), METRALE_TC(_turbo3),
                   METRALE_TC(_turbo2), METRALE_TC(_turbo8), METRALE_TC(_turbo4k_turbo3v),
                   METRALE_TC(_turbo4k_turbo8v), METRALE_TC(_turbo3k_turbo8v), METRALE_TC(_bf16k_turbo4v),
                   METRALE_TC(_bf16k_turbo3v), METRALE_TC(_bf16k_turbo2v), METRALE_TC(_fp8k_turbo4v),
                   METRALE_TC(_fp8k_turbo3v), METRALE_TC(_fp8k_turbo2v),
#if TC_HEAD_MAX <= TC_MAX_D  // (the pair entries: head_dim 64 / 128)
                   METRALE_TC(_pair_turbo3), METRALE_TC(_pair_turbo4k_turbo3v), METRALE_TC(_pair_fp8k_turbo3v),
#endif
    };
#undef METRALE_TC
    for (const auto& e : entries)
        if (std::strcmp(e.suffix, suffix) == 0) return e.fn;
    std::fprintf(stderr, "no tensor-core decode paged_decode_attn_tc%s\n", suffix);
    std::abort();
}

// paged_decode_attn_tc<suffix> over grid = (hk, batch, chunks * num_splits), then the combine over
// (hq, batch) when split; with counters (batch * hk * chunks zeroed words) the launch combines its
// splits itself (rotating the output back by v_signs when given), as CudaOps launches it.
extern "C" void host_paged_decode_tc(const bf16_t* q, const void* k_cache, const void* v_cache,
                                     const int* block_tables, const int* seq_lens, bf16_t* out,
                                     float* part_o, float* part_ml, const float* k_scale,
                                     const float* v_scale, float scale, int hq, int hk, int head_dim,
                                     int max_blocks, int num_splits, int batch, int chunks, const char* suffix,
                                     unsigned* counters, const float* v_signs) {
    const TcDecode entry = tc_entry(suffix);
    auto decode = [&] {
        entry(q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_ml, k_scale, v_scale, scale, hq, hk,
              head_dim, max_blocks, num_splits, counters, v_signs);
    };
    if (counters == nullptr) {
        run_paged_decode(hk, batch, chunks * num_splits, TC_THREADS, decode, part_o, part_ml, seq_lens, out, hq,
                         head_dim, num_splits);
        return;
    }
    for (int z = 0; z < chunks * num_splits; ++z)
        for (int y = 0; y < batch; ++y)
            for (int x = 0; x < hk; ++x) run_block({(unsigned)x, (unsigned)y, (unsigned)z}, TC_THREADS, decode);
}

// paged_decode_rope_tc / paged_decode_rope_tc_fp8 (or their _preload entries) over its grid (hk,
// batch, chunks * num_splits); it combines its splits itself: by counter, or with `cluster` the
// num_splits splits of each (KV head, sequence, chunk) as one cluster (CudaOps's launch where
// rope_decode_cluster allows one), through their shared memory.
extern "C" void host_paged_decode_rope_tc(const bf16_t* q, const bf16_t* k, const bf16_t* v, void* k_cache,
                                          void* v_cache, const int* slot_mapping, const int* positions,
                                          const float* cos_table, const float* sin_table, const bf16_t* q_norm,
                                          const bf16_t* k_norm, const int* block_tables, const int* seq_lens,
                                          bf16_t* out, float* part_o, float* part_ml, unsigned* counters,
                                          const float* k_scale, const float* v_scale, float scale, int q_stride,
                                          int k_stride, int v_stride, int hq, int hk, int head_dim, int rot_dim,
                                          int max_blocks, int num_splits, float eps, int batch, int chunks,
                                          int fp8, int preload, int cluster) {
    auto entry = preload ? (fp8 ? paged_decode_rope_tc_preload_fp8 : paged_decode_rope_tc_preload)
                         : (fp8 ? paged_decode_rope_tc_fp8 : paged_decode_rope_tc);
    auto cta = [&] {
        entry(q, k, v, k_cache, v_cache, slot_mapping, positions, cos_table, sin_table, q_norm, k_norm, block_tables,
              seq_lens, out, part_o, part_ml, counters, k_scale, v_scale, scale, q_stride, k_stride, v_stride, hq, hk,
              head_dim, rot_dim, max_blocks, num_splits, eps);
    };
    gridDim = {(unsigned)hk, (unsigned)batch, (unsigned)(chunks * num_splits)};
    for (int chunk = 0; chunk < chunks; ++chunk)
        for (int y = 0; y < batch; ++y)
            for (int x = 0; x < hk; ++x) {
                std::vector<EmulatedIndex> splits;
                for (int s = 0; s < num_splits; ++s)
                    splits.push_back({(unsigned)x, (unsigned)y, (unsigned)(chunk * num_splits + s)});
                if (cluster) {
                    run_cluster(splits, TC_THREADS, cta);
                } else {
                    for (const EmulatedIndex& b : splits) run_block(b, TC_THREADS, cta);
                }
            }
    gridDim = {1, 1, 1};
}
