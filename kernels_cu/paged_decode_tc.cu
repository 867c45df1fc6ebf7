// Tensor-core paged decode attention for every KV dtype at head_dim 64 and 128, and built with
// TC_HEAD_MAX=256 (the paged_decode_tc_wide module) at 256 (the one-launch decode attention for the
// bf16 and fp8 caches). paged_decode.cu serves every other head_dim. A 256-dim head's tile is
// decoded by two warps, 128 dims each, which add their scores through shared memory (decode_tc).
//
// A CTA owns up to 8 query heads of one KV head's group (a larger group takes several CTAs, which
// read the same K/V, mostly from L2), one sequence and one split of its context; its TC_WARPS
// warps take 16-key tiles in turn (a tile is one cache block: splits start at multiples of 16
// keys). Both products are m16n8k16 MMAs with the heads as the 8-wide N side:
//   S^T = K Q^T     A = 16 keys x 16 dims of K, B = q: one MMA per 16 dims,
//   O^T += V^T P^T  A = 16 dims x 16 keys of V, B = P: one MMA per 16 output dims.
// Each lane loads its operands straight from the cache with 16-byte loads, no shared memory.
// K: lane 4g + c reads keys g and g + 8, their 16-byte chunks c, c + 4, c + 8, ... (the 4 lanes of
// a key read 64 contiguous bytes); as loaded these are A fragments, with the MMAs' head_dim index
// a permutation of the dims (q is loaded through the same one: tc_dim). V: lane 4g + c reads dims
// D/8 g .. D/8 (g + 1) of keys 2c, 2c + 1, 8 + 2c, 9 + 2c (8 lanes read a key's row), and
// byte permutes pair a dim of two keys into one A register; the output's rows are dims in that
// order (tc_out_dim). S^T's registers hold 2 heads x 2 keys per lane; packed and transposed
// (movmatrix), they are P's B fragment. The online softmax runs per warp in the log2 domain (a
// head's 8 lanes exchange maxima by three shuffles); the warps merge through shared memory, into
// the final output or a split's partial (max, sum, unnormalised output), which
// paged_decode_combine<suffix> reduces.
//
// bf16 cache: bf16 MMAs, q as stored, P rounded to bf16. fp8 cache: e4m3 converts exactly to f16,
// so the MMAs are f16 ones: q is scaled by a power of two into f16's range (undone on the
// scores), P rounded to f16; k_scale scales the scores and v_scale the output. A head's sum uses
// its P as rounded, so the output is exactly a weighted mean of the V rows read.
//
// Packed sides (nvfp4, turbo2/3/4/8): lane c's share of a key's K is the c-th quarter of its dims
// (q is loaded through the same order), a V share the g-th eighth, each one load of its codes and
// one of its group scales; each value is dequantized as it is used, eight codes at a time
// (decode_tc.cuh's tc_word: a codebook side's table lookups by byte permutes of tables in
// registers, the signs or-ed in; nvfp4's codes shifted into place as f16 bits, 2^-14 times their
// values, the 2^14 taken back in the fp32 scores and output; one multiply by the group scale a
// pair), so a packed tile costs no more registers than its codes. nvfp4 and the codebook sides run f16 MMAs (q scaled as for fp8; P rounded to f16),
// turbo8 (bf16 scales) bf16 ones. A rotated side's Q rotation stays outside (rope_and_cache's
// rotate_q); the in-launch split combine rotates a rotated V side's output back.
#include "cluster.cuh"
#include "decode_tc.cuh"
#include "head_norm.cuh"
#include "kv_write.cuh"
#include "pdl.cuh"
#include "split_combine.cuh"
#include "timeline.cuh"

// The decode launch's shared memory, one copy for every head_dim (a __shared__ array declared in
// decode_tc_entry would be one per instantiation, all of them allocated).
struct DecodeShared {
    float o[TC_WARPS * TC_ROWS * TC_MAX_D];  // decode_tc's warp partials
    float ml[TC_WARPS * TC_ROWS * 2];
    CombineShared combine;
    float v_signs[2 * TC_HEAD_MAX];  // a rotated V side's signs, staged before the PDL wait
};

// Pull one side's vectors of KV head kvh in cache block `block` into L2 (codes and scales of a
// packed side), without waiting.
template <int D, int F>
__device__ void tc_prefetch_l2(const void* pool, long long block, int kvh, int hk) {
    const unsigned char* p = static_cast<const unsigned char*>(pool);
    if constexpr (TcFmt<F>::kPacked) {
        typedef PackedBlock<D, TcFmt<F>::kBits, TcFmt<F>::kScaleBytes> Block;
        pdl_prefetch_l2(p + Block::data(block, kv_row(0, kvh), hk), ATTN_BLOCK * Block::kDataBytes);
        pdl_prefetch_l2(p + Block::scales(block, kv_row(0, kvh), hk),
                        ATTN_BLOCK * Block::kGroups * TcFmt<F>::kScaleBytes);
    } else {
        constexpr int B = F == TC_FP8 ? 1 : 2;
        pdl_prefetch_l2(p + (block * ATTN_BLOCK * hk + kv_row(0, kvh)) * (D * B), ATTN_BLOCK * D * B);
    }
}

// Before the PDL wait of a programmatic launch (pdl.cuh: nothing the launch just before writes):
// each warp's first tile pulled into L2 (the new key's block too: L2 takes its write coherently,
// only this launch's reads wait) and a rotated V side's signs staged for the combine. Its own
// call, so the decode's registers are allocated as without it.
template <int D, int KF, int VF>
__device__ __noinline__ void decode_tc_prologue(DecodeShared& sh, const void* k_cache, const void* v_cache,
                                                const int* block_tables, const int* seq_lens, int num_kv_heads,
                                                int max_blocks, int num_splits, const float* v_signs) {
    const int b = blockIdx.y, split = blockIdx.z % num_splits;
    const int len = __ldcg(seq_lens + b), per_split = split_keys(len, num_splits), begin = split * per_split;
    const int first = begin + 16 * ((threadIdx.x >> 5) / tc_parts<D>());  // its unit's first tile (decode_tc)
    if ((threadIdx.x & 31) < 2 && first < min(len, begin + per_split)) {
        const long long block = __ldcg(block_tables + (long long)b * max_blocks + first / ATTN_BLOCK);
        if (threadIdx.x & 1) tc_prefetch_l2<D, VF>(v_cache, block, blockIdx.x, num_kv_heads);
        else tc_prefetch_l2<D, KF>(k_cache, block, blockIdx.x, num_kv_heads);
    }
    if (v_signs != nullptr && num_splits > 1) {
        for (int i = threadIdx.x; i < 2 * D; i += TC_THREADS) sh.v_signs[i] = v_signs[i];
    }
}

template <int D, int KF, int VF, bool PAIR = false>
__device__ void decode_tc_entry(DecodeShared& sh, const bf16_t* q, const void* k_cache, const void* v_cache,
                                const int* block_tables, const int* seq_lens, bf16_t* out,
                                float* part_o, float* part_ml, const float* k_scale,
                                const float* v_scale, float scale, int num_q_heads, int num_kv_heads,
                                int max_blocks, int num_splits, unsigned* counters, const float* v_signs) {
    TL_BEGIN(2);  // the timeline build's marks (tools/attention_timeline.py): kind 2, 1 = after the PDL wait
    TL_MARK(1);
    float* smem_o = sh.o;
    float* smem_ml = sh.ml;
    CombineShared& csh = sh.combine;
    const int b = blockIdx.y, chunk = blockIdx.z / num_splits, split = blockIdx.z % num_splits;
    const int len = seq_lens[b], per_split = split_keys(len, num_splits), begin = split * per_split;
    const int group = num_q_heads / num_kv_heads, rows = min(TC_ROWS, group - chunk * TC_ROWS);
    const long long head0 = (long long)b * num_q_heads + (long long)blockIdx.x * group + chunk * TC_ROWS;
    // the signs as decode_tc_prologue staged them (read after barriers)
    const SplitCombine combine{part_o, part_ml, out, counters, v_signs == nullptr ? nullptr : sh.v_signs, num_splits};
    const bool combines = num_splits > 1 && counters != nullptr;
    if (num_splits > 1 && begin >= len) {  // the combine skips it; split 0 of an empty context combines none
        if (combines && len == 0 && split == 0) combine_rows<D>(combine, csh, head0, rows, 0, smem_o);
        TL_MARK(5);
        return;
    }
    const TcWork w{q + head0 * D,
                   static_cast<const unsigned char*>(k_cache),
                   static_cast<const unsigned char*>(v_cache),
                   block_tables + (long long)b * max_blocks,
                   head0,
                   rows,
                   num_kv_heads,
                   (int)blockIdx.x,
                   begin,
                   min(len, begin + per_split),
                   num_splits,
                   split,
                   KF == TC_FP8 ? scale * *k_scale : scale,
                   VF == TC_FP8 ? *v_scale : 1.0f,
                   out,
                   num_splits > 1 ? part_o : nullptr,
                   part_ml,
                   smem_o,
                   smem_ml};
    decode_tc<D, KF, VF, TC_WARPS, PAIR>(w);
    TL_MARK(2);  // the split decoded: its output or partials written
    if (!combines) {
        TL_MARK(5);
        return;
    }
    const int chunks = (group + TC_ROWS - 1) / TC_ROWS, active = active_splits(len, num_splits);
    const bool last = last_split(combine, csh, (b * num_kv_heads + blockIdx.x) * chunks + chunk, active);
    TL_MARK(3);  // the split counter taken
    if (last) {
        combine_rows<D>(combine, csh, head0, rows, active, smem_o);  // decode_tc is done with smem_o
        TL_MARK(4);  // the combine done
    }
    TL_MARK(5);
}

// f(TcDim<D>{}) at the module's head_dim D: paged_decode_tc's 64 or 128, paged_decode_tc_wide's
// 256 (nothing at another).
template <int D>
struct TcDim {
    static constexpr int value = D;
};
template <class F>
__device__ __forceinline__ void tc_at_head_dim(int head_dim, F&& f) {
#if TC_HEAD_MAX > TC_MAX_D
    if (head_dim == 256) f(TcDim<256>{});
#else
    if (head_dim == 64) f(TcDim<64>{});
    else if (head_dim == 128) f(TcDim<128>{});
#endif
}

// The arguments of paged_decode_attn<suffix> (paged_decode.cu), then counters and v_signs; grid =
// (Hk, B, chunks * num_splits) with chunks = ceil(group / TC_ROWS), block = TC_THREADS; head_dim 64
// or 128 (256 in paged_decode_tc_wide). With a split context and counters (B * Hk * chunks zeroed
// words, left zero) the launch combines its splits itself, as paged_decode_combine<suffix> with
// v_signs (a rotated V side's signs, or null) would; without counters the partials go to that
// kernel (the same split rule and partial layout).
// Resident CTAs per SM: bf16 4 (112 registers), fp8 3 (at 4 it spilled, and was slower without), the
// packed sides 4 (128 registers) where that measured faster on an H200, else 3: turbo8 spills 104
// bytes at 4, turbo4k_turbo8v 16, turbo3k_turbo8v (8 bytes) ran 2-3% slower at 4, and fp8k_turbo2v
// 3% slower at batch 1 and 16; turbo4 and fp8k_turbo4v spilled at 4 until their decode lost
// instructions (aa8aad9) and were not measured at 4 since (docs/performance.md). The host
// mirrors them (KV_DTYPES' TensorCoreDecode.ctas_per_sm) when it picks the split count.
// TC_CTAS_ALL (a build variant for measurements, tools/batch_decode.py): every entry but the pair
// ones at that many.
#ifdef TC_CTAS_ALL
#define TC_CTAS_OF(n) TC_CTAS_ALL
#else
#define TC_CTAS_OF(n) n
#endif
#define METRALE_TC_ENTRY(name, kf, vf, min_ctas, pair)                                            \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, (pair) ? (min_ctas) : TC_CTAS_OF(min_ctas)) \
        name(const bf16_t* q, const void* k_cache, const void* v_cache, const int* block_tables, \
             const int* seq_lens, bf16_t* out, float* part_o, float* part_ml,                    \
             const float* k_scale, const float* v_scale, float scale, int num_q_heads,           \
             int num_kv_heads, int head_dim, int max_blocks, int num_splits, unsigned* counters, \
             const float* v_signs) {                                                             \
        __shared__ DecodeShared sh;                                                              \
        tc_at_head_dim(head_dim, [&](auto d) {                                                   \
            decode_tc_prologue<decltype(d)::value, kf, vf>(sh, k_cache, v_cache, block_tables,   \
                                                           seq_lens, num_kv_heads, max_blocks,   \
                                                           num_splits, v_signs);                 \
        });                                                                                      \
        pdl_wait();                                                                              \
        pdl_launch_dependents();                                                                 \
        tc_at_head_dim(head_dim, [&](auto d) {                                                   \
            decode_tc_entry<decltype(d)::value, kf, vf, pair>(                                   \
                sh, q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_ml, k_scale,   \
                v_scale, scale, num_q_heads, num_kv_heads, max_blocks, num_splits, counters,      \
                v_signs);                                                                        \
        });                                                                                      \
    }
METRALE_TC_ENTRY(paged_decode_attn_tc, TC_BF16, TC_BF16, 4, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_fp8, TC_FP8, TC_FP8, 3, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_nvfp4, TC_NVFP4, TC_NVFP4, 4, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_turbo4, TC_TURBO4, TC_TURBO4, 3, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_turbo3, TC_TURBO3, TC_TURBO3, 4, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_turbo2, TC_TURBO2, TC_TURBO2, 4, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_turbo8, TC_TURBO8, TC_TURBO8, 3, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_turbo4k_turbo3v, TC_TURBO4, TC_TURBO3, 4, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_turbo4k_turbo8v, TC_TURBO4, TC_TURBO8, 3, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_turbo3k_turbo8v, TC_TURBO3, TC_TURBO8, 3, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_bf16k_turbo4v, TC_BF16, TC_TURBO4, 4, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_bf16k_turbo3v, TC_BF16, TC_TURBO3, 4, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_bf16k_turbo2v, TC_BF16, TC_TURBO2, 4, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_fp8k_turbo4v, TC_FP8, TC_TURBO4, 3, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_fp8k_turbo3v, TC_FP8, TC_TURBO3, 4, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_fp8k_turbo2v, TC_FP8, TC_TURBO2, 3, false)
// The batch-1 entries paged_decode_attn_tc_pair<suffix> (KV_DTYPES' TensorCoreDecode.pair): the
// same decode and combine, bit for bit, with two tiles a pass (decode_tc's PAIR: the scoring of
// one tile beside the softmax and dequantization of the other, twice the loaded tiles'
// registers), at TC_PAIR_CTAS CTAs an SM. The host launches one where its grid fits that many an
// SM: batch 1 at long contexts, where a split's warps run their tiles one after another and the
// SMs are not full. Head_dim 64 and 128 only.
#define TC_PAIR_CTAS 2
#if TC_HEAD_MAX <= TC_MAX_D  // (two tiles a pass where a warp holds a head: not in paged_decode_tc_wide)
METRALE_TC_ENTRY(paged_decode_attn_tc_pair_turbo3, TC_TURBO3, TC_TURBO3, TC_PAIR_CTAS, true)
METRALE_TC_ENTRY(paged_decode_attn_tc_pair_turbo4k_turbo3v, TC_TURBO4, TC_TURBO3, TC_PAIR_CTAS, true)
METRALE_TC_ENTRY(paged_decode_attn_tc_pair_fp8k_turbo3v, TC_FP8, TC_TURBO3, TC_PAIR_CTAS, true)
#endif
#undef METRALE_TC_ENTRY

// --- paged_decode_rope_tc<suffix>: a decode step's attention in one launch (bf16 / fp8 cache) --
// rope_and_cache_<dtype>, paged_decode_attn_tc<suffix> and paged_decode_combine<suffix> fused:
// each CTA normalizes and rotates its query heads into shared memory (head_norm.cuh: the
// arithmetic of rope_and_cache), the CTAs of the split that holds a sequence's last key also
// write the new K / V to the cache (kv_write.cuh's element stores) before they read it (splits
// are whole cache blocks: no other CTA reads that block), and with a split context the last split
// of a (sequence, KV head, chunk) to finish (a counter each) reduces the partials exactly as
// paged_decode_combine does. Output and cache bytes are those of the three launches.
struct RopeDecodeArgs {
    const bf16_t *q, *k, *v;
    void *k_cache, *v_cache;
    const int *slot_mapping, *positions;
    const float *cos_table, *sin_table;
    const bf16_t *q_norm, *k_norm;
    const int *block_tables, *seq_lens;
    bf16_t* out;
    float *part_o, *part_ml;
    unsigned* counters;
    const float *k_scale, *v_scale;
    float scale;
    int q_stride, k_stride, v_stride, hq, hk, rot_dim, max_blocks, num_splits;
    float eps;
};

#define TC_STAGED_BLOCKS 64
#define TC_MAX_CLUSTER 16  // the most splits combined in a cluster (a non-portable cluster size)

// The kernel's shared memory (one copy for every head_dim).
struct RopeDecodeShared {
    float o[TC_WARPS * TC_ROWS * TC_MAX_D];  // decode_tc's warp partials
    float ml[TC_WARPS * TC_ROWS * 2];
    alignas(16) bf16_t q[TC_ROWS * TC_HEAD_MAX];  // the CTA's query heads after norm + RoPE
    alignas(16) bf16_t k[TC_HEAD_MAX];  // the new key after norm + RoPE
    CombineShared combine;
    // Loaded before the PDL wait: the position's cos and sin halves, the QK-norm weights and the
    // split's block-table entries (when the split has at most TC_STAGED_BLOCKS blocks).
    float cos_sin[TC_HEAD_MAX];
    alignas(16) bf16_t q_norm[TC_HEAD_MAX];
    alignas(16) bf16_t k_norm[TC_HEAD_MAX];
    int blocks[TC_STAGED_BLOCKS];
    // In a cluster: the split's partial (decode_tc's keep_o / keep_ml), read by the cluster's CTAs.
    float part_o[TC_ROWS * TC_HEAD_MAX];
    float part_ml[TC_ROWS * 2];
    alignas(16) bf16_t v[TC_HEAD_MAX];  // the new value as its warp read it (the preloading entries)
};

// The cache's element store (kv_write.cuh).
template <bool FP8>
struct TcStore {
    typedef store_bf16 type;
};
template <>
struct TcStore<true> {
    typedef store_fp8 type;
};

// The one-launch decode's cache format (both sides): fp8 or bf16.
template <bool FP8>
constexpr int tc_rope_format = FP8 ? TC_FP8 : TC_BF16;

// The split's attention over its keys (the q rows staged): its partial to part_o / part_ml, to
// shared memory in a cluster, or the output when the context is not split. `first`: each warp's
// first tile as preloaded (PRELOAD), else unread.
template <int D, bool FP8, bool PRELOAD>
__device__ void decode_rope_split(const RopeDecodeArgs& a, RopeDecodeShared& sh, bool staged, const int* table,
                                  long long head0, int rows, int kvh, int begin, int end, int split, bool clustered,
                                  const TcTile<D, tc_rope_format<FP8>, tc_rope_format<FP8>>* first) {
    const bool split_ = a.num_splits > 1;
    const TcWork w{sh.q,
                   static_cast<const unsigned char*>(a.k_cache),
                   static_cast<const unsigned char*>(a.v_cache),
                   staged ? sh.blocks - begin / ATTN_BLOCK : table,  // indexed by tile / ATTN_BLOCK
                   head0,
                   rows,
                   a.hk,
                   kvh,
                   begin,
                   end,
                   a.num_splits,
                   split,
                   FP8 ? a.scale * *a.k_scale : a.scale,
                   FP8 ? *a.v_scale : 1.0f,
                   a.out,
                   split_ && !clustered ? a.part_o : nullptr,
                   a.part_ml,
                   sh.o,
                   sh.ml,
                   split_ && clustered ? sh.part_o : nullptr,
                   sh.part_ml};
    decode_tc<D, tc_rope_format<FP8>, tc_rope_format<FP8>>(w, PRELOAD ? first : nullptr);
}

// Bytes off .. off + 3 of a cached row (element side W) as the cache write stores them from src.
template <class W>
__device__ __forceinline__ unsigned cached_word(const bf16_t* src, int off, float scale) {
    if constexpr (sizeof(typename W::Elem) == 2) {
        return (unsigned)W::convert(src[off / 2], scale) | (unsigned)W::convert(src[off / 2 + 1], scale) << 16;
    } else {
        unsigned x = 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) x |= (unsigned)W::convert(src[off + i], scale) << (8 * i);
        return x;
    }
}

// The new key (tile row `key` of a warp's preloaded tile) as the cache write stores it: K from the
// staged key, V from the staged value, in the lanes that hold that row (TcLoader's shares).
template <int D, int F, class W>
__device__ void patch_new_key(TcTile<D, F, F>& t, int key, const bf16_t* k, const bf16_t* v, const float* k_scale,
                              const float* v_scale) {
    typedef TcLoader<D, F, F> L;
    static_assert(L::PARTS == 1 && !TcFmt<F>::kPacked, "element sides, a head a warp");
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const float ks = k_scale == nullptr ? 1.0f : *k_scale, vs = v_scale == nullptr ? 1.0f : *v_scale;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (g + 8 * h != key) continue;
#pragma unroll
        for (int i = 0; i < L::NC; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) t.k[h].c[i].w[j] = cached_word<W>(k, c * 16 + 64 * i + 4 * j, ks);
    }
#pragma unroll
    for (int x = 0; x < 4; ++x) {
        if (tc_v_key(c, x) != key) continue;
#pragma unroll
        for (int m = 0; m < L::VW; ++m) t.v[x].w[m] = cached_word<W>(v, g * (L::VW * 4) + 4 * m, vs);
    }
}

// The split combine of a cluster whose CTAs are the splits of one (sequence, KV head, chunk), each
// holding its partial in shared memory: CTA `rank` reduces heads rank, rank + cluster, .. of the
// chunk from the `active` splits' partials, read across the cluster, with combine_rows' arithmetic
// in its order (the output is the counter path's bit for bit). One cluster barrier before (the
// partials written), one after (no CTA leaves while another reads its shared memory; relaxed, so
// that it does not wait for the out stores). A thread's first element's partials are read with
// the weights' (max, sum) pairs, so that both are one trip across the cluster, not one after the
// other.
template <int D>
__device__ void cluster_combine(const RopeDecodeArgs& a, RopeDecodeShared& sh, long long head0, int rows,
                                int active) {
    const unsigned rank = cluster_rank(), size = cluster_ctas();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int mine = (int)rank < rows ? (rows - (int)rank + (int)size - 1) / (int)size : 0;  // <= TC_WARPS
    auto load_partials = [&](int idx, float (&p)[TC_MAX_CLUSTER]) {  // element idx's partials, split by split
        const int r = (int)rank + idx / D * (int)size, d = idx % D;
#pragma unroll
        for (int s = 0; s < TC_MAX_CLUSTER; ++s) p[s] = s < active ? cluster_load(&sh.part_o[r * D + d], s) : 0.0f;
    };
    cluster_sync();
    const bool weighs = warp < mine && active > 0;  // warp i: the weights of head rank + i * size
    float m = METRALE_NEG_INF, l_in = 0.0f;
    if (weighs && lane < active) {
        const int r = (int)rank + warp * (int)size;
        m = cluster_load(&sh.part_ml[r * 2], lane);
        l_in = cluster_load(&sh.part_ml[r * 2 + 1], lane);
    }
    float p[TC_MAX_CLUSTER];
    if (active > 0 && (int)threadIdx.x < mine * D) load_partials(threadIdx.x, p);
    if (weighs) {
        float big = m;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
        const float w = (lane < active && big != METRALE_NEG_INF) ? exp2f(m - big) : 0.0f;
        const float l = warp_sum(lane < active ? l_in * w : 0.0f);
        sh.combine.weight[warp][lane] = w;
        if (lane == 0) sh.combine.total[warp] = l;
    }
    __syncthreads();
    for (int idx = threadIdx.x; active > 0 && idx < mine * D; idx += TC_THREADS) {
        const int i = idx / D, d = idx % D, r = (int)rank + i * (int)size;
        if (idx != (int)threadIdx.x) load_partials(idx, p);
        float val = 0.0f;
#pragma unroll
        for (int s = 0; s < TC_MAX_CLUSTER; ++s)
            if (s < active) val += p[s] * sh.combine.weight[i][s];
        const float t = sh.combine.total[i];
        a.out[(head0 + r) * D + d] = f32_to_bf16(t > 0.0f ? val / t : 0.0f);
    }
    cluster_arrive_relaxed();  // the out stores need no release: the launch's end publishes them
    cluster_wait();
}

// Whether the RoPE of a head row can run from registers: its pairs are half / 8 chunks apart, a
// power of two (every rotary width here, partial ones included).
__device__ __forceinline__ bool rope_by_chunks(int half) {
    const int pc = half / 8;
    return half % 8 == 0 && pc > 0 && (pc & (pc - 1)) == 0;
}

// The default entries' staging where a head has at most 128 dims, a CTA more query heads than
// warps, and rope_by_chunks(half): each row the CTA stages (its query heads; the new key and value
// where the split writes them: at most TC_ROWS + 2) goes to a group of 8 lanes, four groups a
// warp, so the whole staging is one pass:
// one trip to L2 a lane and one row's arithmetic, where a warp took its rows one after another
// (three trips and three rows at eight query heads a KV head). Lane l of a group holds chunks l
// and l + 8 of its row. The arithmetic is norm_rope's in its order (the sum of squares as
// warp_sum adds the chunks' sums: chunks c and c + 8 in the lane, then the group's lanes by
// shuffle), and the key and value go to the cache as store_elements stores them: the same bytes.
template <int D, class Store>
__device__ __forceinline__ void stage_rows_grouped(const RopeDecodeArgs& a, RopeDecodeShared& sh, int b, int head,
                                                   int rows, int kvh, int slot, bool idle, bool writes,
                                                   const float* cos_row, const float* sin_row, int half,
                                                   const bf16_t* q_norm, const bf16_t* k_norm) {
    constexpr int LANES = 8, CPL = D / 64;  // lanes a row, chunks a lane
    static_assert(D == 64 || D == 128, "a row's chunks over 8 lanes, one or two a lane");
    static_assert(TC_ROWS + 2 <= TC_THREADS / LANES, "every staged row in one pass");
    const int lane = threadIdx.x & 31, gl = lane & (LANES - 1);
    const int x = (int)threadIdx.x / LANES;  // this group's row: a query head, then the key, the value
    const bool is_q = x < rows && !idle, is_k = writes && x == rows, is_v = writes && x == rows + 1;
    const bf16_t* src = is_q   ? a.q + b * a.q_stride + (head + x) * D
                        : is_k ? a.k + b * a.k_stride + kvh * D
                        : is_v ? a.v + b * a.v_stride + kvh * D
                               : nullptr;
    const float* scale = is_k ? a.k_scale : a.v_scale;
    const float sc = (is_k || is_v) && scale != nullptr ? *scale : 1.0f;
    float f[CPL][8] = {};
    if (src != nullptr && aligned16(src)) {  // a lane's chunks loaded before either is used: one trip
        Words<4> raw[CPL];
#pragma unroll
        for (int k = 0; k < CPL; ++k) raw[k] = *reinterpret_cast<const Words<4>*>(src + 8 * (gl + LANES * k));
#pragma unroll
        for (int k = 0; k < CPL; ++k)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                f[k][2 * i] = __uint_as_float(raw[k].w[i] << 16);
                f[k][2 * i + 1] = __uint_as_float(raw[k].w[i] & 0xffff0000u);
            }
    } else if (src != nullptr) {
#pragma unroll
        for (int k = 0; k < CPL; ++k) load_chunk(src + 8 * (gl + LANES * k), false, f[k]);
    }
    // head_sum_squares' value: warp_sum over the chunks' sums (chunk c at lane c) adds c and c ^ 8
    // first (chunks past D / 8 add zeros before), then c ^ 4, c ^ 2, c ^ 1.
    float ss = add_squares<8>(0.0f, f[0]);
    if constexpr (CPL == 2) ss = ss + add_squares<8>(0.0f, f[1]);
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const bf16_t* w = is_q ? q_norm : is_k ? k_norm : nullptr;
    const float inv = w == nullptr ? 0.0f : inv_rms(ss, D, a.eps);
    // Straight-line arithmetic: every lane takes the same instructions and selects its row's
    // result, where branches on the row kind cost each element a divergent branch and reconvergence.
    const bool normed = w != nullptr;
    float y[CPL][8];  // the normalized row's bf16 values (the value: its own)
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
        float g[8] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
        if (normed) load_chunk(w + 8 * (gl + LANES * k), aligned16(w), g);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float n = rms_scaled(f[k][j], g[j], inv);
            y[k][j] = round_bf16(normed ? n : f[k][j]);
        }
    }
    // RoPE: chunk c pairs with c ^ pc, in this lane where pc is 8 (a whole 128-dim head), else in
    // lane l ^ pc of the group (pc < 8: only chunks below 8 turn).
    const int pc = half / 8;
    float z[CPL][8];  // the pair's other element, for each element that turns
    if (pc >= LANES) {  // (uniform: half is the launch's)
#pragma unroll
        for (int k = 0; k < CPL; ++k)
#pragma unroll
            for (int j = 0; j < 8; ++j) z[k][j] = y[CPL - 1 - k][j];
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) z[0][j] = __shfl_xor_sync(0xffffffffu, y[0][j], pc);
#pragma unroll
        for (int k = 1; k < CPL; ++k)
#pragma unroll
            for (int j = 0; j < 8; ++j) z[k][j] = 0.0f;  // (chunks from 8 on do not turn)
    }
    // rope_pair's arithmetic, (x1, x2) the pair's first and second: x1 cos - x2 sin for the first,
    // x2 cos + x1 sin for the second. round_bf16(-v) is -round_bf16(v) (the rounding is on the
    // magnitude; a NaN stores as the same canonical NaN), so the sign is one product by +-1.
    float out[CPL][8];
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
        const int c = gl + LANES * k, base = 8 * (c & (pc - 1));
        const bool turns = (is_q || is_k) && c < 2 * pc;
        const float sign = c < pc ? -1.0f : 1.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float cs = cos_row[base + j], sn = sin_row[base + j];  // rounded when staged
            const float r = round_bf16(y[k][j] * cs) + sign * round_bf16(z[k][j] * sn);
            out[k][j] = turns ? r : y[k][j];
        }
    }
    typename Store::Elem* cache =
        is_k ? static_cast<typename Store::Elem*>(a.k_cache) : static_cast<typename Store::Elem*>(a.v_cache);
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
        const int c = gl + LANES * k;
        if (is_q) store_vec<8>(sh.q + x * D + 8 * c, out[k]);
        if (is_k || is_v) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
                cache[kv_vector(slot, kvh, a.hk) * D + 8 * c + j] = Store::convert(f32_to_bf16(out[k][j]), sc);
        }
    }
}

// PRE (the _preload entries, which the host takes where a KV head has few query heads: the
// 2026-12-05 8989300 to 9d6084f section of docs/performance.md): each warp loads its first tile
// into registers before the PDL wait (its keys were cached by earlier steps), so that the tile's
// trip overlaps the wait and the staging instead of following them. The split that writes the new
// key patches that key's row, in the lanes that hold it, from the staged key and value as the cache
// write stores them. A head of two warps' parts (256) loads as without it.
template <int D, bool FP8, bool PRE>
__device__ void decode_rope_tc(const RopeDecodeArgs& a, RopeDecodeShared& sh) {
    typedef typename TcStore<FP8>::type Store;
    constexpr bool PRELOAD = PRE && tc_parts<D>() == 1;
    TL_BEGIN(FP8 ? 1 : 0);
    const int warp = threadIdx.x >> 5;
    const int b = blockIdx.y, kvh = blockIdx.x, chunk = blockIdx.z / a.num_splits, split = blockIdx.z % a.num_splits;
    // Before the wait, what does not come from the launch just before (pdl.cuh): the step's
    // inputs (through L2: an earlier launch wrote them), the constants, and the earlier keys'
    // cache blocks, pulled into L2. The new key's K / V come after the wait.
    const int len = __ldcg(a.seq_lens + b), per_split = split_keys(len, a.num_splits), begin = split * per_split;
    const int end = min(len, begin + per_split);
    const int group = a.hq / a.hk, chunks = (group + TC_ROWS - 1) / TC_ROWS;
    const int rows = min(TC_ROWS, group - chunk * TC_ROWS);
    const int head = kvh * group + chunk * TC_ROWS;  // the CTA's first query head of the token
    const long long head0 = (long long)b * a.hq + head;
    const int half = a.rot_dim / 2, slot = __ldcg(a.slot_mapping + b);
    // The split holding the last key (split 0 of an empty context) writes the new K / V, as
    // rope_and_cache writes every token whose slot is set.
    const bool writes = slot >= 0 && split == (len > 0 ? (len - 1) / per_split : 0);
    const bool idle = a.num_splits > 1 && begin >= len;  // the combine skips it
    const int* table = a.block_tables + (long long)b * a.max_blocks;
    const bool staged = (end - begin + ATTN_BLOCK - 1) / ATTN_BLOCK <= TC_STAGED_BLOCKS;
    if (!idle || writes) {
        const long long pos = __ldcg(a.positions + b);
        for (int i = threadIdx.x; i < half; i += TC_THREADS) {
            // Stored rounded to bf16, as every reader rounds them (rope_pair, stage_rows_grouped):
            // round_bf16 of a bf16 value is that value, so norm_rope's results do not change, and
            // the grouped staging reads them as they are, off its lanes' path after the wait.
            sh.cos_sin[i] = round_bf16(a.cos_table[pos * half + i]);
            sh.cos_sin[half + i] = round_bf16(a.sin_table[pos * half + i]);
        }
        for (int i = threadIdx.x; i < D; i += TC_THREADS) {
            if (a.q_norm != nullptr) sh.q_norm[i] = a.q_norm[i];
            if (a.k_norm != nullptr) sh.k_norm[i] = a.k_norm[i];
        }
        if (staged) {
            for (int i = threadIdx.x; begin + i * ATTN_BLOCK < end; i += TC_THREADS) {
                sh.blocks[i] = __ldcg(table + begin / ATTN_BLOCK + i);
            }
        }
        const int tile = begin + 16 * (warp / tc_parts<D>());  // this warp's unit's first tile (decode_tc)
        if (!PRELOAD && (threadIdx.x & 31) < 2 && tile < end) {
            tc_prefetch_l2<D, tc_rope_format<FP8>>((threadIdx.x & 1) ? a.v_cache : a.k_cache,
                                                      __ldcg(table + tile / ATTN_BLOCK), kvh, a.hk);
        }
    }
    __syncthreads();
    const int tile0 = begin + 16 * warp;  // this warp's first tile (PRELOAD: a head a warp)
    TcTile<D, tc_rope_format<FP8>, tc_rope_format<FP8>> first;
    if (PRELOAD && !idle && tile0 < end) {
        const TcLoader<D, tc_rope_format<FP8>, tc_rope_format<FP8>> load(
            static_cast<const u8_t*>(a.k_cache), static_cast<const u8_t*>(a.v_cache),
            staged ? sh.blocks - begin / ATTN_BLOCK : table, a.hk, kvh, end);  // decode_rope_split's
        load(tile0, first);
    }
    pdl_wait();
    pdl_launch_dependents();
    TL_MARK(1);
    if (idle && len == 0 && split == 0) {  // an empty context: the combine writes zeros
        for (int idx = threadIdx.x; idx < rows * D; idx += TC_THREADS) a.out[head0 * D + idx] = f32_to_bf16(0.0f);
    }
    // In a cluster (the splits of one (sequence, KV head, chunk): rope_cache_decode's launch when
    // they are few) every CTA takes part in the combine, an idle one too.
    const bool clustered = cluster_ctas() > 1;
    if (idle && !writes && !clustered) {
        TL_MARK(5);
        return;
    }
    const float *cos_row = sh.cos_sin, *sin_row = sh.cos_sin + half;
    const bf16_t* q_norm = a.q_norm == nullptr ? nullptr : sh.q_norm;
    const bf16_t* k_norm = a.k_norm == nullptr ? nullptr : sh.k_norm;
    bool grouped = false;  // the rows staged in one pass (stage_rows_grouped)
    if constexpr (!PRE && D <= 128) {
        // Only where a warp would stage two or more query heads: with at most one (four query
        // heads a KV head, Qwen3-8B) the per-warp loop takes one trip too, with a quarter of the
        // arithmetic a lane (on an H100 the grouped pass made that attention 1 µs longer).
        grouped = rows > TC_WARPS && rope_by_chunks(half);
        if (grouped) {
            stage_rows_grouped<D, Store>(a, sh, b, head, rows, kvh, slot, idle, writes, cos_row, sin_row, half, q_norm,
                                         k_norm);
#if defined(METRALE_TIMELINE) && TL_MARKS > 8
            TL_MARK(6);  // warp 0 (thread 0 stamps): its rows staged, in one pass
#endif
        }
    }
    for (int x = warp; !grouped && x < rows + 2; x += TC_WARPS) {
        if (x < rows) {
            if (!idle) norm_rope<D>(a.q + b * a.q_stride + (head + x) * D, q_norm, a.eps, cos_row, sin_row, half,
                                    sh.q + x * D);
        } else if (writes && x == rows) {
            norm_rope<D>(a.k + b * a.k_stride + kvh * D, k_norm, a.eps, cos_row, sin_row, half, sh.k);
            store_elements<Store, D>(sh.k, a.k_cache, slot, kvh, a.hk, a.k_scale);
        } else if (writes) {
            if constexpr (PRELOAD) {  // kept for the patch; each lane reads back its own elements
                store_row<D>(a.v + b * a.v_stride + kvh * D, sh.v);
                store_elements<Store, D>(sh.v, a.v_cache, slot, kvh, a.hk, a.v_scale);
            } else {
                store_elements<Store, D>(a.v + b * a.v_stride + kvh * D, a.v_cache, slot, kvh, a.hk, a.v_scale);
            }
        }
#if defined(METRALE_TIMELINE) && TL_MARKS > 8
        if (x / TC_WARPS < 3) TL_MARK(6 + x / TC_WARPS);  // warp 0 (thread 0 stamps): each row it staged
#endif
    }
    if (idle && !clustered) {
        TL_MARK(5);
        return;
    }
    if (!idle) {
        __syncthreads();  // q rows staged; the new K / V stored (visible to this CTA's loads)
        TL_MARK(2);
        if constexpr (PRELOAD) {
            if (writes && len - 1 >= tile0 && len - 1 < tile0 + 16)
                patch_new_key<D, tc_rope_format<FP8>, Store>(first, len - 1 - tile0, sh.k, sh.v, a.k_scale,
                                                                a.v_scale);
        }
        decode_rope_split<D, FP8, PRELOAD>(a, sh, staged, table, head0, rows, kvh, begin, end, split, clustered,
                                           &first);
    }
    TL_MARK(3);
    if (a.num_splits == 1) {
        TL_MARK(5);
        return;
    }
    const int active = active_splits(len, a.num_splits);
    if (clustered) {
        cluster_combine<D>(a, sh, head0, rows, active);
        TL_MARK(5);
        return;
    }
    const SplitCombine combine{a.part_o, a.part_ml, a.out, a.counters, nullptr, a.num_splits};
    const bool is_last = last_split(combine, sh.combine, (b * a.hk + kvh) * chunks + chunk, active);
    TL_MARK(4);
    if (is_last) combine_rows<D>(combine, sh.combine, head0, rows, active, nullptr);
    TL_MARK(5);
}

// q / k / v: Hq / Hk / Hk heads of head_dim bf16 per sequence, sequence b's at b * {q,k,v}_stride
// (views of a fused q/k/v projection); k_cache / v_cache: the pools (NB, Hk, 16, D); slot_mapping,
// positions: (B,) int32; cos / sin, q_norm / k_norm (or null): as for rope_and_cache_<dtype>; the
// rest as for paged_decode_attn_tc<suffix>, plus counters: B * Hk * chunks zeroed words (each
// launch leaves them zero).
// The new key's cache block must be its sequence's alone (the block allocator's rule): the CTAs
// of other splits and sequences never read it while it is written. grid = (Hk, B, chunks *
// num_splits), block = TC_THREADS; head_dim 64 or 128 (256 in paged_decode_tc_wide). Resident CTAs
// per SM as the unfused tensor-core decodes: bf16 4, fp8 3. paged_decode_rope_tc_preload<suffix>:
// the same with each warp's first tile loaded before the PDL wait (decode_rope_tc's PRE); the same
// bytes.
#define METRALE_ROPE_TC_ENTRY(name, fp8, min_ctas, pre)                                              \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, min_ctas)                              \
        name(const bf16_t* q, const bf16_t* k, const bf16_t* v, void* k_cache, void* v_cache,        \
             const int* slot_mapping, const int* positions, const float* cos_table,                 \
             const float* sin_table, const bf16_t* q_norm, const bf16_t* k_norm,                    \
             const int* block_tables, const int* seq_lens, bf16_t* out, float* part_o,              \
             float* part_ml, unsigned* counters, const float* k_scale, const float* v_scale,        \
             float scale, int q_stride, int k_stride, int v_stride, int hq, int hk, int head_dim,   \
             int rot_dim, int max_blocks, int num_splits, float eps) {                              \
        const RopeDecodeArgs a{q,        k,        v,          k_cache,  v_cache,  slot_mapping,    \
                               positions, cos_table, sin_table, q_norm,  k_norm,   block_tables,    \
                               seq_lens, out,      part_o,     part_ml,  counters, k_scale,         \
                               v_scale,  scale,    q_stride,   k_stride, v_stride, hq,              \
                               hk,       rot_dim,  max_blocks, num_splits, eps};                    \
        __shared__ RopeDecodeShared sh;                                                             \
        tc_at_head_dim(head_dim, [&](auto d) { decode_rope_tc<decltype(d)::value, fp8, pre>(a, sh); }); \
    }
METRALE_ROPE_TC_ENTRY(paged_decode_rope_tc, false, 4, false)
METRALE_ROPE_TC_ENTRY(paged_decode_rope_tc_fp8, true, 3, false)
METRALE_ROPE_TC_ENTRY(paged_decode_rope_tc_preload, false, 4, true)
METRALE_ROPE_TC_ENTRY(paged_decode_rope_tc_preload_fp8, true, 3, true)
#undef METRALE_ROPE_TC_ENTRY
