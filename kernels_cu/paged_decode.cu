// Paged decode attention: one query token per sequence over its cached context.
// Every paged_decode* module: the K / V side types and the names' suffix come from -D defines
// (paged_attention.cuh); paged_decode is bf16, paged_decode_fp8 e4m3, paged_decode_turbo4_128
// turbo4 up to head_dim 256, paged_decode_fp8k_turbo4v an fp8 K side with a turbo4 V side, ...
//
// grid = (Hk, B, ceil(G / RowsPerCta<D>) * num_splits), block = ATTN_THREADS. With num_splits > 1
// each CTA covers 1/num_splits of the sequence's context and writes partials that
// paged_decode_combine<suffix> reduces; num_splits is fixed by the caller (graph-capture safe).
#include "paged_attention.cuh"

template <int D>
__device__ void decode(const bf16_t* q, const void* k_cache, const void* v_cache,
                       const int* block_tables, const int* seq_lens, bf16_t* out, float* part_o,
                       float* part_ml, float qk_scale, float v_scale, int num_q_heads,
                       int num_kv_heads, int max_blocks, int num_splits, float* smem) {
    constexpr int RW = RowsPerCta<D>::value;
    const int group = num_q_heads / num_kv_heads;
    const int b = blockIdx.y, chunk = blockIdx.z / num_splits, split = blockIdx.z % num_splits;
    const int len = seq_lens[b];
    const int per_split = (len + num_splits - 1) / num_splits;
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

// q: (B, Hq, D) bf16; caches: (NB, 16, Hk, D) bf16 / e4m3 or (NB, block_bytes) uint8 per side;
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
    fill_luts();
    const float qk = scale * kv_scale<KSide<64>>(k_scale), vs = kv_scale<VSide<64>>(v_scale);
#define METRALE_DECODE(D)                                                                     \
    decode<D>(q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_ml, qk, vs,      \
              num_q_heads, num_kv_heads, max_blocks, num_splits, smem)
    switch (head_dim) {
        case 64: METRALE_DECODE(64); break;
        case 128: METRALE_DECODE(128); break;
        case 256: METRALE_DECODE(256); break;
#if ATTN_MAX_D >= 512
        case 512: METRALE_DECODE(512); break;
#endif
    }
#undef METRALE_DECODE
}

// Reduce split partials: out[b, h] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s.
// grid = (Hq, B), block = 128.
extern "C" __global__ void KV_ENTRY(paged_decode_combine)(const float* part_o,
                                                          const float* part_ml, bf16_t* out,
                                                          int num_q_heads, int head_dim,
                                                          int num_splits) {
    const long long head = (long long)blockIdx.y * num_q_heads + blockIdx.x;
    const float* ml = part_ml + head * num_splits * 2;
    float big = METRALE_NEG_INF;
    for (int s = 0; s < num_splits; ++s) big = fmaxf(big, ml[2 * s]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f, val = 0.0f;
        if (big != METRALE_NEG_INF) {
            for (int s = 0; s < num_splits; ++s) {
                const float f = exp2f(ml[2 * s] - big);
                sum += ml[2 * s + 1] * f;
                val += part_o[(head * num_splits + s) * head_dim + d] * f;
            }
        }
        out[head * head_dim + d] = f32_to_bf16(sum > 0.0f ? val / sum : 0.0f);
    }
}
