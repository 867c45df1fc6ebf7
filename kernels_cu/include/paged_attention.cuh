// The one paged-attention body behind decode and chunked prefill, bf16 or e4m3 KV.
//
// A CTA owns up to RW "rows" (query vectors of one KV head's query group) and a key range.
// Its ATTN_WARPS warps split the keys (key = begin + warp, + ATTN_WARPS, ...); each lane holds
// D/32 consecutive elements of every row's q and accumulator, so K/V rows are read once per
// warp as one coalesced vector load and reused by all RW rows. Softmax is online, in the log2
// domain; warps merge through shared memory at the end. A row attends keys 0..limit inclusive.
//
// Compile with -DKV_FP8 for e4m3 caches (scores scaled by k_scale, output by v_scale).
#pragma once
#include "numeric.cuh"
#include "reduce.cuh"

#define ATTN_WARPS 4
#define ATTN_THREADS (ATTN_WARPS * 32)
#define ATTN_MAX_D 256
#define ATTN_BLOCK 16
#define LOG2E 1.4426950408889634f

#ifdef KV_FP8
typedef fp8_t kv_t;
#define KV_ENTRY(name) name##_fp8
#else
typedef bf16_t kv_t;
#define KV_ENTRY(name) name
#endif

// Rows held per CTA: the host mirrors this rule (metrale_cli/kernels/cuda_ops.py).
template <int D>
struct RowsPerCta {
    static const int value = D <= 128 ? 8 : 4;
};

struct AttnRows {
    long long q_off[8];   // element offset of each row's q and output; -1 = no row
    int limit[8];         // last key position the row may attend
    long long part[8];    // partial-result index (split decode), unused otherwise
};

struct AttnKv {
    const kv_t* k_cache;
    const kv_t* v_cache;
    const int* block_table;
    int num_kv_heads;
    int kv_head;
};

struct AttnOut {
    bf16_t* out;       // final (normalised) output, used when part_o is null
    float* part_o;     // split decode: unnormalised partial outputs (.., D)
    float* part_ml;    // split decode: (max, sum) per partial, log2 domain
};

template <int D>
__device__ __forceinline__ long long kv_offset(const AttnKv& kv, int key) {
    const long long block = kv.block_table[key / ATTN_BLOCK];
    return ((block * ATTN_BLOCK + key % ATTN_BLOCK) * kv.num_kv_heads + kv.kv_head) * D;
}

// Merge the warps' (m, l, acc) of one row through shared memory and write it.
template <int D>
__device__ void merge_row(const float* acc, float m, float l, bool valid, long long q_off,
                          long long part, float v_scale, const AttnOut& o, float* smem) {
    constexpr int EPL = D / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* mine = smem + warp * (D + 2);
    if (lane == 0) {
        mine[D] = m;
        mine[D + 1] = l;
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) mine[lane * EPL + e] = acc[e];
    __syncthreads();
    if (valid) {
        float big = METRALE_NEG_INF;
        for (int w = 0; w < ATTN_WARPS; ++w) big = fmaxf(big, smem[w * (D + 2) + D]);
        for (int d = threadIdx.x; d < D; d += ATTN_THREADS) {
            float sum = 0.0f, val = 0.0f;
            if (big != METRALE_NEG_INF) {
                for (int w = 0; w < ATTN_WARPS; ++w) {
                    const float* theirs = smem + w * (D + 2);
                    const float f = exp2f(theirs[D] - big);  // 0 for an idle warp (m = -inf)
                    sum += theirs[D + 1] * f;
                    val += theirs[d] * f;
                }
            }
            val *= v_scale;
            if (o.part_o == nullptr) {
                o.out[q_off + d] = f32_to_bf16(sum > 0.0f ? val / sum : 0.0f);
            } else {
                o.part_o[part * D + d] = val;
                if (d == 0) {
                    o.part_ml[part * 2] = big;
                    o.part_ml[part * 2 + 1] = sum;
                }
            }
        }
    }
    __syncthreads();
}

template <int D, int RW>
__device__ void attend_rows(const bf16_t* q, const AttnRows& rows, int key_begin, int key_end,
                            const AttnKv& kv, float qk_scale, float v_scale, const AttnOut& o,
                            float* smem) {
    constexpr int EPL = D / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float qr[RW][EPL], acc[RW][EPL], m[RW], l[RW];
    const float q_mul = qk_scale * LOG2E;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        m[r] = METRALE_NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            acc[r][e] = 0.0f;
            // q rows may be unaligned views: scalar loads, once per CTA.
            qr[r][e] = rows.q_off[r] < 0
                           ? 0.0f
                           : bf16_to_f32(q[rows.q_off[r] + lane * EPL + e]) * q_mul;
        }
    }
    // Software-pipelined: the next key's K/V loads are in flight while this key is scored, so a
    // warp waits for memory once per split rather than once per key.
    float kf[EPL], vf[EPL];
    int key = key_begin + warp;
    if (key < key_end) {
        const long long off = kv_offset<D>(kv, key) + lane * EPL;
        load_vec<EPL>(kv.k_cache + off, kf);
        load_vec<EPL>(kv.v_cache + off, vf);
    }
    for (; key < key_end; key += ATTN_WARPS) {
        float kn[EPL], vn[EPL], s[RW];
        const int next = key + ATTN_WARPS;
        if (next < key_end) {
            const long long off = kv_offset<D>(kv, next) + lane * EPL;
            load_vec<EPL>(kv.k_cache + off, kn);
            load_vec<EPL>(kv.v_cache + off, vn);
        }
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            float dot = 0.0f;
            if (rows.q_off[r] >= 0) {  // uniform: idle rows skip their reduction
#pragma unroll
                for (int e = 0; e < EPL; ++e) dot += qr[r][e] * kf[e];
                dot = warp_sum(dot);
            }
            s[r] = dot;
        }
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            if (rows.q_off[r] < 0 || key > rows.limit[r]) continue;  // uniform across the warp
            const float m_new = fmaxf(m[r], s[r]);
            const float corr = exp2f(m[r] - m_new);
            const float p = exp2f(s[r] - m_new);
            l[r] = l[r] * corr + p;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[r][e] = acc[r][e] * corr + p * vf[e];
            m[r] = m_new;
        }
        if (next < key_end) {
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                kf[e] = kn[e];
                vf[e] = vn[e];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        merge_row<D>(acc[r], m[r], l[r], rows.q_off[r] >= 0, rows.q_off[r], rows.part[r], v_scale,
                     o, smem);
    }
}

// Per-variant scale reads: the bf16 body ignores the (1,) scale tensors.
__device__ __forceinline__ float kv_scale(const float* p) {
#ifdef KV_FP8
    return *p;
#else
    return 1.0f;
#endif
}
