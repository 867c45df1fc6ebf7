// Paged decode attention: one query token per sequence over its cached context.
// Every paged_decode* module: the K / V side types and the names' suffix come from -D defines
// (paged_attention.cuh); paged_decode is bf16, paged_decode_fp8 e4m3, paged_decode_turbo4_128
// turbo4 up to head_dim 256, paged_decode_fp8k_turbo4v an fp8 K side with a turbo4 V side, ...
//
// grid = (Hk, B, ceil(G / rows) * num_splits), block = ATTN_THREADS, where a CTA holds `rows`
// query heads of one KV head's group (the rule below the decode body). num_splits is fixed by
// the caller (graph-capture safe); with num_splits > 1 a sequence's context is cut into splits
// of split_keys(len) keys, a CTA whose split starts past the context exits at once, and
// paged_decode_combine<suffix> reduces the active splits.
#include "paged_attention.cuh"
#include "pdl.cuh"
#include "wht.cuh"

template <int D, int RW>
__device__ void decode(const bf16_t* q, const void* k_cache, const void* v_cache,
                       const int* block_tables, const int* seq_lens, bf16_t* out, float* part_o,
                       float* part_ml, float qk_scale, float v_scale, int num_q_heads,
                       int num_kv_heads, int max_blocks, int num_splits, float* smem) {
    const int group = num_q_heads / num_kv_heads;
    const int b = blockIdx.y, chunk = blockIdx.z / num_splits, split = blockIdx.z % num_splits;
    const int len = seq_lens[b];
    const int per_split = split_keys(len, num_splits);
    const int begin = split * per_split;
    const int end = min(len, begin + per_split);
    AttnRows rows;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        const int g = chunk * RW + r;
        const long long head = (long long)b * num_q_heads + blockIdx.x * group + g;
        rows.q_off[r] = g < group ? head * D : -1;
        rows.limit[r] = len - 1;
        rows.part[r] = head * num_splits + split;
    }
    const AttnKv kv{k_cache, v_cache, block_tables + (long long)b * max_blocks, num_kv_heads,
                    (int)blockIdx.x};
    const AttnOut o{out, num_splits > 1 ? part_o : nullptr, part_ml};
    attend_rows<D, RW>(q, rows, begin, end, kv, qk_scale, v_scale, o, smem);
}

// q: (B, Hq, D) bf16; caches: (NB, Hk, 16, D) bf16 / e4m3 or (NB, block_bytes) uint8 per side;
// block_tables: (B, max_blocks) int32; seq_lens: (B,) int32; out: (B, Hq, D) bf16;
// part_o: (B, Hq, num_splits, D) fp32 and part_ml: (B, Hq, num_splits, 2) fp32 when
// num_splits > 1 (else unused); k_scale, v_scale: (1,) fp32 (read only by an fp8 side).
// head_dim: 64, 128, 256, and 512 where ATTN_MAX_D is 512.
// Query heads per CTA: 2 for groups of 1-2 and 4 otherwise at head_dim <= 128 (a larger group
// takes several CTAs, which read the same K/V, mostly from L2), RowsPerCta above: few idle
// rows, and registers left for the key pipeline. The host mirrors it (cuda_ops.decode_rows).

// q: (B, Hq, D) bf16; caches: (NB, Hk, 16, D) bf16 / e4m3 or (NB, block_bytes) uint8 per side;
// block_tables: (B, max_blocks) int32; seq_lens: (B,) int32; out: (B, Hq, D) bf16;
// part_o: (B, Hq, num_splits, D) fp32 and part_ml: (B, Hq, num_splits, 2) fp32 when
// num_splits > 1 (else unused); k_scale, v_scale: (1,) fp32 (read only by an fp8 side).
// head_dim: 64, 128, 256, and 512 where ATTN_MAX_D is 512.
extern "C" __global__ void ATTN_BOUNDS
    KV_ENTRY(paged_decode_attn)(const bf16_t* q, const void* k_cache, const void* v_cache,
                                const int* block_tables, const int* seq_lens, bf16_t* out,
                                float* part_o, float* part_ml, const float* k_scale,
                                const float* v_scale, float scale, int num_q_heads,
                                int num_kv_heads, int head_dim, int max_blocks, int num_splits) {
    __shared__ float smem[ATTN_WARPS * (ATTN_MAX_D + 2)];
    if (num_splits > 1) {  // a split past the context: nothing to do, the combine skips it
        const int len = seq_lens[blockIdx.y];
        if ((int)(blockIdx.z % num_splits) * split_keys(len, num_splits) >= len) return;
    }
    fill_luts();
    const float qk = scale * kv_scale<KSide<64>>(k_scale), vs = kv_scale<VSide<64>>(v_scale);
    const int group = num_q_heads / num_kv_heads;
#define METRALE_DECODE(D, RW)                                                                 \
    decode<D, RW>(q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_ml, qk, vs,  \
                  num_q_heads, num_kv_heads, max_blocks, num_splits, smem)
#define METRALE_DECODE_GROUPED(D)                                                             \
    if (group <= 2) METRALE_DECODE(D, 2);                                                     \
    else METRALE_DECODE(D, 4)
    switch (head_dim) {
        case 64: METRALE_DECODE_GROUPED(64); break;
        case 128: METRALE_DECODE_GROUPED(128); break;
        case 256: METRALE_DECODE(256, RowsPerCta<256>::value); break;
#if ATTN_MAX_D >= 512
        case 512: METRALE_DECODE(512, RowsPerCta<512>::value); break;
#endif
    }
#undef METRALE_DECODE_GROUPED
#undef METRALE_DECODE
}

// Reduce the active split partials of each head: out[b, h] = sum_s 2^(m_s - M) o_s /
// sum_s 2^(m_s - M) l_s over s < active_splits(seq_lens[b]). grid = (Hq, B), block = 128;
// num_splits <= 32 (the host's MAX_SPLITS): warp 0 weighs the splits, then every thread sums
// its elements with independent loads. v_signs: a rotated V side's (2, D) WHT signs, then each
// head is rotated back (R^T, as wht_bf16_inplace_inv on the stored bf16 row), else null.
extern "C" __global__ void KV_ENTRY(paged_decode_combine)(const float* part_o,
                                                          const float* part_ml,
                                                          const int* seq_lens, bf16_t* out,
                                                          int num_q_heads, int head_dim,
                                                          int num_splits, const float* v_signs) {
    __shared__ float weight[32];
    __shared__ float total;
    __shared__ float row[ATTN_MAX_D];
    pdl_wait();
    pdl_launch_dependents();
    const long long head = (long long)blockIdx.y * num_q_heads + blockIdx.x;
    const int active = active_splits(seq_lens[blockIdx.y], num_splits);
    if (threadIdx.x < 32) {
        const int s = threadIdx.x;
        const float* ml = part_ml + (head * num_splits + s) * 2;
        const float m = s < active ? ml[0] : METRALE_NEG_INF;
        float big = m;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
        const float w = (s < active && big != METRALE_NEG_INF) ? exp2f(m - big) : 0.0f;
        const float l = warp_sum(s < active ? ml[1] * w : 0.0f);
        weight[s] = w;
        if (s == 0) total = l;
    }
    __syncthreads();
    const float* po = part_o + head * num_splits * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float val = 0.0f;
#pragma unroll 8
        for (int s = 0; s < active; ++s) val += po[s * head_dim + d] * weight[s];
        const bf16_t o = f32_to_bf16(total > 0.0f ? val / total : 0.0f);
        if (v_signs == nullptr) out[head * head_dim + d] = o;
        else row[d] = bf16_to_f32(o);
    }
    if (v_signs == nullptr) return;
    __syncthreads();
    if (threadIdx.x < 32) {
        const float *first = v_signs + head_dim, *last = v_signs;  // R^T: S2 first
        switch (head_dim) {
            case 64: wht_rotate<64>(row, first, last); break;
            case 128: wht_rotate<128>(row, first, last); break;
#if ATTN_MAX_D >= 256
            case 256: wht_rotate<256>(row, first, last); break;
#endif
#if ATTN_MAX_D >= 512
            case 512: wht_rotate<512>(row, first, last); break;
#endif
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) out[head * head_dim + d] = f32_to_bf16(row[d]);
}
