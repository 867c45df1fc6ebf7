// Causal chunked-prefill attention of one sequence's chunk over the paged cache.
// Every prefill_paged* module: side types and names from -D defines (paged_attention.cuh), e.g.
// prefill_paged (bf16), prefill_paged_fp8, prefill_paged_turbo4 (attn_prefill_paged_turbo4_64).
//
// Rows are the chunk's (token, query head of the group) pairs of one KV head, flattened as
// token * G + g; a CTA takes RowsPerCta<D> consecutive rows (a tile of queries) and scans keys
// 0 .. start_pos + its last token. grid = (Hk, ceil(T * G / RowsPerCta<D>)).
#include "paged_attention.cuh"

template <int D>
__device__ void prefill(const bf16_t* q, const void* k_cache, const void* v_cache,
                        const int* block_table, bf16_t* out, float qk_scale, float v_scale,
                        int num_tokens, int start_pos, int num_q_heads, int num_kv_heads,
                        float* smem) {
    constexpr int RW = RowsPerCta<D>::value;
    const int group = num_q_heads / num_kv_heads;
    const long long total_rows = (long long)num_tokens * group;
    const long long first = (long long)blockIdx.y * RW;
    AttnRows rows;
    int key_end = 0;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        const long long i = first + r;
        const int t = (int)(i / group), g = (int)(i % group);
        const bool valid = i < total_rows;
        rows.q_off[r] = valid ? ((long long)t * num_q_heads + blockIdx.x * group + g) * D : -1;
        rows.limit[r] = start_pos + t;
        rows.part[r] = 0;
        if (valid) key_end = max(key_end, start_pos + t + 1);
    }
    const AttnKv kv{k_cache, v_cache, block_table, num_kv_heads, (int)blockIdx.x};
    const AttnOut o{out, nullptr, nullptr};
    attend_rows<D, RW>(q, rows, 0, key_end, kv, qk_scale, v_scale, o, smem);
}

// q, out: (T, Hq, D) bf16 at positions start_pos .. start_pos+T-1; caches as in paged_decode;
// block_table: (MB,) int32; k_scale, v_scale: (1,) fp32 (read by an fp8 side).
// head_dim: 64, 128, 256, and 512 where ATTN_MAX_D is 512.
extern "C" __global__ void ATTN_BOUNDS
    KV_ENTRY(attn_prefill_paged)(const bf16_t* q, const void* k_cache, const void* v_cache,
                                 const int* block_table, bf16_t* out, const float* k_scale,
                                 const float* v_scale, float scale, int num_tokens,
                                 int start_pos, int num_q_heads, int num_kv_heads,
                                 int head_dim) {
    __shared__ float smem[ATTN_WARPS * (ATTN_MAX_D + 2)];
    fill_luts();
    const float qk = scale * kv_scale<KSide<64>>(k_scale), vs = kv_scale<VSide<64>>(v_scale);
#define METRALE_PREFILL(D)                                                                   \
    prefill<D>(q, k_cache, v_cache, block_table, out, qk, vs, num_tokens, start_pos,         \
               num_q_heads, num_kv_heads, smem)
    switch (head_dim) {
        case 64: METRALE_PREFILL(64); break;
        case 128: METRALE_PREFILL(128); break;
        case 256: METRALE_PREFILL(256); break;
#if ATTN_MAX_D >= 512
        case 512: METRALE_PREFILL(512); break;
#endif
    }
#undef METRALE_PREFILL
}
