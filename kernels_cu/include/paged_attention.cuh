// The one paged-attention body behind decode and chunked prefill, for every KV side type.
//
// A CTA owns up to RW "rows" (query vectors of one KV head's query group) and a key range.
// Its ATTN_WARPS warps split the keys (key = begin + warp, + ATTN_WARPS, ...); each lane holds
// D/32 consecutive elements of every row's q and accumulator, so K/V rows are read once per
// warp as one coalesced load and reused by all RW rows. Softmax is online, in the log2
// domain; warps merge through shared memory at the end. A row attends keys 0..limit inclusive.
//
// The K and V element types are chosen per module by -D defines (the registry's table):
//   K_SIDE, V_SIDE   bf16 (default), fp8, nvfp4, turbo2, turbo3, turbo4, turbo8
//                    (kv_formats.cuh: side_<name><D> loads and decodes a lane's elements)
//   KV_SUFFIX        appended to the entry points' names (_fp8, _turbo4, _turbo4_64, ...)
//   ATTN_MAX_D       the largest head_dim instantiated: 256 (default) or 512
// An fp8 side scales scores by k_scale / the output by v_scale; the other sides' values are
// decoded as stored (a rotated side stays in the rotated basis).
#pragma once
#include "kv_formats.cuh"
#include "reduce.cuh"

#define ATTN_WARPS 4
#define ATTN_THREADS (ATTN_WARPS * 32)
#define ATTN_BLOCK 16
#define LOG2E 1.4426950408889634f

#ifndef K_SIDE
#define K_SIDE bf16
#endif
#ifndef V_SIDE
#define V_SIDE K_SIDE
#endif
#ifndef KV_SUFFIX
#define KV_SUFFIX
#endif
#ifndef ATTN_MAX_D
#define ATTN_MAX_D 256
#endif

// At least one CTA per SM is all the bound asks: without a minimum ptxas caps the bodies at 128
// registers and spills inside the key loop.
#ifndef ATTN_MIN_CTAS
#define ATTN_MIN_CTAS 1
#endif
#define ATTN_BOUNDS __launch_bounds__(ATTN_THREADS, ATTN_MIN_CTAS)

#define METRALE_CAT_(a, b) a##b
#define METRALE_CAT(a, b) METRALE_CAT_(a, b)
#define KV_ENTRY(name) METRALE_CAT(name, KV_SUFFIX)

template <int D>
using KSide = METRALE_CAT(side_, K_SIDE)<D>;
template <int D>
using VSide = METRALE_CAT(side_, V_SIDE)<D>;

// Rows held per CTA: the host mirrors this rule (metrale_cli/kernels/cuda_ops.py).
template <int D>
struct RowsPerCta {
    static const int value = D <= 128 ? 8 : D <= 256 ? 4 : 2;
};

// Keys per batch of a warp (attend_rows): P * RW <= 16 dot products reduced together, and about
// 64 bytes of K+V per lane in each of the two batches in flight (a lane holds D/32 elements per
// side): short rows (fp8, packed sides) take more keys per batch.
template <int D, int RW>
struct KeyBatch {
    static const int bytes = (int)(sizeof(typename KSide<D>::Raw) + sizeof(typename VSide<D>::Raw));
    static const int by_bytes = bytes <= 8 ? 8 : bytes <= 16 ? 4 : bytes <= 32 ? 2 : 1;
    static const int value = by_bytes < 16 / RW ? by_bytes : 16 / RW;
};

// Context keys per split of a split decode: at least ATTN_SPLIT_MIN_KEYS, so a short context
// runs on few splits (and the combine reads only those); the host mirrors it (MIN_KEYS_PER_SPLIT).
// A whole number of cache blocks, so a split's 16-key tiles are blocks (paged_decode_tc.cu).
#define ATTN_SPLIT_MIN_KEYS 32
__device__ __forceinline__ int split_keys(int len, int num_splits) {
    const int keys = max((len + num_splits - 1) / num_splits, ATTN_SPLIT_MIN_KEYS);
    return (keys + ATTN_BLOCK - 1) / ATTN_BLOCK * ATTN_BLOCK;
}
__device__ __forceinline__ int active_splits(int len, int num_splits) {
    return min(num_splits, (len + split_keys(len, num_splits) - 1) / split_keys(len, num_splits));
}

struct AttnRows {
    long long q_off[8];   // element offset of each row's q and output; -1 = no row
    int limit[8];         // last key position the row may attend
    long long part[8];    // partial-result index (split decode), unused otherwise
};

struct AttnKv {
    const void* k_cache;
    const void* v_cache;
    const int* block_table;
    int num_kv_heads;
    int kv_head;
};

struct AttnOut {
    bf16_t* out;       // final (normalised) output, used when part_o is null
    float* part_o;     // split decode: unnormalised partial outputs (.., D)
    float* part_ml;    // split decode: (max, sum) per partial, log2 domain
};

// The code -> value tables of the K and V sides (packed code sides only), filled by the CTA
// before any key is read (nothing to do, and no barrier, for element sides).
__shared__ float attn_luts[2][16];
// Per warp: one batch's probabilities and row statistics (attend_rows).
__shared__ float attn_batch[ATTN_WARPS][32];

__device__ __forceinline__ void fill_luts() {
    if constexpr (KSide<64>::kLevels > 0 || VSide<64>::kLevels > 0) {
        if (threadIdx.x < 16) {
            const int t = threadIdx.x;
            attn_luts[0][t] = t < KSide<64>::kLevels ? KSide<64>::level(t) : 0.0f;
            attn_luts[1][t] = t < VSide<64>::kLevels ? VSide<64>::level(t) : 0.0f;
        }
        __syncthreads();
    }
}

// One key's K and V elements of this lane as loaded, decoded only when the key is scored.
template <int D>
struct KvRaw {
    typename KSide<D>::Raw k;
    typename VSide<D>::Raw v;
};

template <int D>
__device__ __forceinline__ KvRaw<D> load_key(const AttnKv& kv, int key, int lane) {
    const long long block = kv.block_table[key / ATTN_BLOCK];
    const int row = kv_row(key % ATTN_BLOCK, kv.kv_head);
    return KvRaw<D>{KSide<D>::load(kv.k_cache, block, row, kv.num_kv_heads, lane),
                    VSide<D>::load(kv.v_cache, block, row, kv.num_kv_heads, lane)};
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
    // Keys go in batches of P per warp (the warp's keys are key_begin + warp + i * ATTN_WARPS),
    // the next batch's K/V loads in flight while this one is scored. The P * RW dot products of
    // a batch are reduced together (transposed butterfly: NV - 1 shuffles for NV values instead
    // of 5 per value), after which lane L holds value L / G = p * RW + r; the online softmax
    // then runs once per batch, and the probabilities reach every lane through shared memory.
    constexpr int P = KeyBatch<D, RW>::value;
    constexpr int NV = P * RW;  // <= 16
    constexpr int G = 32 / NV;
    constexpr int LOG_NV = NV >= 16 ? 4 : NV >= 8 ? 3 : NV >= 4 ? 2 : NV >= 2 ? 1 : 0;
    constexpr int STEP = P * ATTN_WARPS;
    float* wbuf = attn_batch[warp];  // [0, NV): probabilities, [16, 16 + RW): row max, [24, ..): row sum
    const int mine = lane / G, my_p = mine / RW, my_r = mine % RW;
    int my_limit = rows.limit[0];
#pragma unroll
    for (int r = 1; r < RW; ++r) my_limit = my_r == r ? rows.limit[r] : my_limit;
    KvRaw<D> cur[P], nxt[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int key = key_begin + warp + p * ATTN_WARPS;
        if (key < key_end) cur[p] = load_key<D>(kv, key, lane);
    }
    for (int base = key_begin + warp; base < key_end; base += STEP) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int key = base + STEP + p * ATTN_WARPS;
            if (key < key_end) nxt[p] = load_key<D>(kv, key, lane);
        }
        float part[NV];
#pragma unroll
        for (int p = 0; p < P; ++p) {
            float kf[EPL];
            if (base + p * ATTN_WARPS < key_end) {  // uniform across the warp
                KSide<D>::decode(cur[p].k, attn_luts[0], kf);
            } else {
#pragma unroll
                for (int e = 0; e < EPL; ++e) kf[e] = 0.0f;
            }
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < EPL; ++e) dot += qr[r][e] * kf[e];
                part[p * RW + r] = dot;
            }
        }
#pragma unroll
        for (int st = 0; st < LOG_NV; ++st) {  // halve the values held, double the lanes summed
            const int half = (NV >> st) / 2, h = 16 >> st;
            const bool upper = (lane & h) != 0;
#pragma unroll
            for (int i = 0; i < half; ++i) {
                const float send = upper ? part[i] : part[i + half];
                const float keep = upper ? part[i + half] : part[i];
                part[i] = keep + __shfl_xor_sync(0xffffffffu, send, h);
            }
        }
        float s = part[0];
#pragma unroll
        for (int h = G / 2; h > 0; h >>= 1) s += __shfl_xor_sync(0xffffffffu, s, h);
        const int key = base + my_p * ATTN_WARPS;
        if (key >= key_end || key > my_limit) s = METRALE_NEG_INF;
        float mx = s;  // the batch's max of this lane's row: lanes of one row differ above RW * G
#pragma unroll
        for (int h = RW * G; h < 32; h <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, h));
        float m_old = m[0];
#pragma unroll
        for (int r = 1; r < RW; ++r) m_old = my_r == r ? m[r] : m_old;
        const float m_new = fmaxf(m_old, mx);
        const float pr = s == METRALE_NEG_INF ? 0.0f : exp2f(s - m_new);
        float psum = pr;
#pragma unroll
        for (int h = RW * G; h < 32; h <<= 1) psum += __shfl_xor_sync(0xffffffffu, psum, h);
        if (lane % G == 0) {
            wbuf[mine] = pr;
            if (my_p == 0) {
                wbuf[16 + my_r] = m_new;
                wbuf[24 + my_r] = psum;
            }
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            const float mr = wbuf[16 + r];
            const float corr = mr == METRALE_NEG_INF ? 1.0f : exp2f(m[r] - mr);
            l[r] = l[r] * corr + wbuf[24 + r];
            m[r] = mr;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[r][e] *= corr;
        }
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (base + p * ATTN_WARPS < key_end) {  // uniform across the warp
                float vf[EPL];
                VSide<D>::decode(cur[p].v, attn_luts[1], vf);
#pragma unroll
                for (int r = 0; r < RW; ++r) {
                    const float pw = wbuf[p * RW + r];
#pragma unroll
                    for (int e = 0; e < EPL; ++e) acc[r][e] += pw * vf[e];
                }
            }
        }
        __syncwarp();
#pragma unroll
        for (int p = 0; p < P; ++p) cur[p] = nxt[p];
    }
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        merge_row<D>(acc[r], m[r], l[r], rows.q_off[r] >= 0, rows.q_off[r], rows.part[r], v_scale,
                     o, smem);
    }
}

// The per-tensor scale of a side: read for fp8, 1 for every other side.
template <class Side>
__device__ __forceinline__ float kv_scale(const float* p) {
    if constexpr (Side::kTensorScale) return *p;
    else return 1.0f;
}
