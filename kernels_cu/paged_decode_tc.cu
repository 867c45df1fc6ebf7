// Tensor-core paged decode attention for the bf16 and fp8 caches at head_dim 64 and 128.
// paged_decode.cu serves every other case (and every other dtype).
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
#include "mma.cuh"
#include "pdl.cuh"
#include "paged_attention.cuh"

#define TC_WARPS 4
#define TC_THREADS (TC_WARPS * 32)
#define TC_MAX_D 128
#define TC_ROWS 8  // query heads per CTA

// Cache elements per 16-byte load.
template <bool FP8>
struct TcElems {
    static const int value = FP8 ? 16 : 8;
};

// Element t of lane c's share of a head vector (t < D / 4): the dim it stands for.
template <bool FP8>
__device__ __forceinline__ int tc_dim(int c, int t) {
    constexpr int E = TcElems<FP8>::value;
    return (4 * (t / E) + c) * E + t % E;
}

template <bool FP8>
__device__ __forceinline__ void tc_mma(float* d, const unsigned* a, const unsigned* b) {
    if constexpr (FP8) mma_f16_16816(d, a, b);
    else mma_bf16_16816(d, a, b);
}

template <bool FP8>
__device__ __forceinline__ unsigned tc_pack(float lo, float hi) {
    if constexpr (FP8) return pack_f16x2(lo, hi);
    else return pack_bf16x2(lo, hi);
}

// The two halves of a packed pair, as rounded.
template <bool FP8>
__device__ __forceinline__ void tc_unpack(unsigned v, float& lo, float& hi) {
    if constexpr (FP8) unpack_f16x2(v, lo, hi);
    else unpack_bf16x2(v, lo, hi);
}

struct TcWork {
    const bf16_t* q;
    const unsigned char* k_cache;
    const unsigned char* v_cache;
    const int* block_table;  // this sequence's row
    long long head0;         // the CTA's first query head (b * Hq + ...)
    int rows;                // its query heads: up to TC_ROWS
    int num_kv_heads, kv_head, begin, end, num_splits, split;
    float qk_scale, v_scale;
    bf16_t* out;
    float* part_o;  // null: write the final output
    float* part_ml;
    float* smem_o;   // [TC_WARPS][TC_ROWS][TC_MAX_D]
    float* smem_ml;  // [TC_WARPS][TC_ROWS][2]
};

// The tile key of this lane's V word set v (0-3): keys 2c, 2c + 1, 8 + 2c, 9 + 2c.
__device__ __forceinline__ int tc_v_key(int c, int v) { return 2 * c + (v & 1) + 8 * (v >> 1); }

// The dim of O^T row 8r + g of output tile n: lane group g holds dims D/8 g .. D/8 g + D/8 of V,
// tile n pairs dims 2n (row g) and 2n + 1 (row g + 8) of them.
template <int D>
__device__ __forceinline__ int tc_out_dim(int n, int r, int g) { return D / 8 * g + 2 * n + r; }

template <int D, bool FP8>
__device__ void decode_tc(const TcWork& w) {
    constexpr int E = TcElems<FP8>::value;
    constexpr int BYTES = FP8 ? 1 : 2;  // per cache element
    constexpr int NC = D / (4 * E);     // 16-byte chunks of a key row per lane
    constexpr int KS = D / 16;          // MMA steps over head_dim (S^T) and output tiles (O^T)
    // fp8: a warp's next tile is loaded before this one is scored (an fp8 tile is half a bf16 one's
    // bytes: without it, too few are in flight). bf16 has no registers to spare for it.
    constexpr bool PREFETCH = FP8;
    constexpr int VW = D / 8 * BYTES / 4;  // V words per key of a lane: D / 8 dims
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;

    // q as the B operand of S^T = K Q^T: head g, elements 4j, 4j + 1 (register 0) and 4j + 2,
    // 4j + 3 (register 1) of this lane's share; zero past the CTA's heads.
    const bool has = g < w.rows;
    const bf16_t* qr = w.q + (w.head0 + g) * D;
    float q_mul = w.qk_scale * LOG2E, q_scale = 1.0f;
    if constexpr (FP8) {
        float amax = 0.0f;
        if (has) {
#pragma unroll
            for (int e = 0; e < D / 4; ++e) amax = fmaxf(amax, fabsf(bf16_to_f32(qr[tc_dim<FP8>(c, e)])));
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        // amax < 2^(x + 1); q * 2^-e stays below 2^15, inside f16's range.
        const int x = (int)((__float_as_uint(amax) >> 23) & 0xffu) - 127;
        const int e = max(0, x - 14);
        q_scale = __uint_as_float((unsigned)(127 - e) << 23);
        q_mul *= __uint_as_float((unsigned)(127 + e) << 23);
    }
    unsigned qb[KS][2];
#pragma unroll
    for (int j = 0; j < KS; ++j) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const int d = tc_dim<FP8>(c, 4 * j + 2 * hi);  // d + 1 is element 4j + 2 hi + 1
            qb[j][hi] = tc_pack<FP8>(has ? bf16_to_f32(qr[d]) * q_scale : 0.0f,
                                     has ? bf16_to_f32(qr[d + 1]) * q_scale : 0.0f);
        }
    }

    // This lane's heads 2c + e (e = 0, 1): running max, sum (over its keys g, g + 8 only; the 8
    // lanes of a head add up at the end) and O^T columns: o[n][e] and o[n][2 + e].
    float m[2] = {METRALE_NEG_INF, METRALE_NEG_INF}, l[2] = {0.0f, 0.0f}, o[KS][4];
#pragma unroll
    for (int n = 0; n < KS; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    // A tile's K and V as this lane loads them (a dead key's slot is still inside the block: its
    // scores are masked, its V zeroed below).
    auto load = [&](int tile, Words<4> (&k)[2][NC], Words<VW> (&v)[4]) {
        const long long block = w.block_table[tile / ATTN_BLOCK];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // K: keys g, g + 8
            const long long row = (block * ATTN_BLOCK + 8 * h + g) * w.num_kv_heads + w.kv_head;
            const unsigned char* kp = w.k_cache + row * (D * BYTES) + c * 16;
#pragma unroll
            for (int i = 0; i < NC; ++i) k[h][i] = *reinterpret_cast<const Words<4>*>(kp + 64 * i);
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {  // V: keys tc_v_key(c, x), dims D/8 g .. D/8 g + D/8
            const long long row = (block * ATTN_BLOCK + tc_v_key(c, x)) * w.num_kv_heads + w.kv_head;
            v[x] = *reinterpret_cast<const Words<VW>*>(w.v_cache + row * (D * BYTES) + g * (VW * 4));
        }
    };
    Words<4> kr[2][NC], kn[2][NC];
    Words<VW> vr[4], vn[4];
    if (PREFETCH && w.begin + 16 * warp < w.end) load(w.begin + 16 * warp, kr, vr);
    for (int tile = w.begin + 16 * warp; tile < w.end; tile += 16 * TC_WARPS) {
        if constexpr (PREFETCH) {  // the warp's next tile is in flight while this one is scored
            if (tile + 16 * TC_WARPS < w.end) load(tile + 16 * TC_WARPS, kn, vn);
        } else {
            load(tile, kr, vr);
        }
        // S^T (16 keys x 8 heads per query tile): K rows g, g + 8 are the A operand as loaded.
        float st[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < KS; ++j) {
            unsigned a[4];  // key g low pair, key g + 8 low pair, key g high pair, key g + 8 high
            if constexpr (FP8) {
                const unsigned x0 = kr[0][j / 4].w[j % 4], x1 = kr[1][j / 4].w[j % 4];
                a[0] = e4m3x4_lo_to_f16x2(x0);
                a[1] = e4m3x4_lo_to_f16x2(x1);
                a[2] = e4m3x4_hi_to_f16x2(x0);
                a[3] = e4m3x4_hi_to_f16x2(x1);
            } else {
                a[0] = kr[0][j / 2].w[(j % 2) * 2];
                a[1] = kr[1][j / 2].w[(j % 2) * 2];
                a[2] = kr[0][j / 2].w[(j % 2) * 2 + 1];
                a[3] = kr[1][j / 2].w[(j % 2) * 2 + 1];
            }
            tc_mma<FP8>(st, a, qb[j]);
        }
        // Online softmax of heads 2c + e over keys g (st[e]) and g + 8 (st[2 + e]);
        // P^T goes back to registers and, transposed, is the B operand of O^T += V^T P^T.
        const bool live0 = tile + g < w.end, live1 = tile + 8 + g < w.end;
        float corr[2], p0[2], p1[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float x0 = live0 ? st[e] * q_mul : METRALE_NEG_INF;
            const float x1 = live1 ? st[2 + e] * q_mul : METRALE_NEG_INF;
            float mx = fmaxf(x0, x1);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
            const float n = fmaxf(m[e], mx);
            corr[e] = n == METRALE_NEG_INF ? 1.0f : exp2f(m[e] - n);
            m[e] = n;
            p0[e] = x0 == METRALE_NEG_INF ? 0.0f : exp2f(x0 - n);
            p1[e] = x1 == METRALE_NEG_INF ? 0.0f : exp2f(x1 - n);
        }
        const unsigned k0 = tc_pack<FP8>(p0[0], p0[1]), k1 = tc_pack<FP8>(p1[0], p1[1]);
        float r0, r1, r2, r3;  // the probabilities as rounded: the sum is of what P V uses
        tc_unpack<FP8>(k0, r0, r1);
        tc_unpack<FP8>(k1, r2, r3);
        l[0] = l[0] * corr[0] + r0 + r2;
        l[1] = l[1] * corr[1] + r1 + r3;
        const unsigned pb[2] = {movmatrix_trans(k0),   // P[head g][keys 2c, 2c + 1]
                                movmatrix_trans(k1)};  // ... keys 8 + 2c, 9 + 2c
        if (corr[0] != 1.0f || corr[1] != 1.0f) {  // most tiles keep the maxima
#pragma unroll
            for (int n = 0; n < KS; ++n) {
                o[n][0] *= corr[0];
                o[n][1] *= corr[1];
                o[n][2] *= corr[0];
                o[n][3] *= corr[1];
            }
        }
#pragma unroll
        for (int v = 0; v < 4; ++v) {  // a dead key's V is zeroed: 0 x NaN would be NaN
            if (tile + tc_v_key(c, v) >= w.end) {
#pragma unroll
                for (int x = 0; x < VW; ++x) vr[v].w[x] = 0u;
            }
        }
        // V^T as the A operand of output tile n: rows g, g + 8 are dims tc_out_dim(n, 0 / 1, g),
        // columns keys 2c, 2c + 1 (registers 0, 1) and 8 + 2c, 9 + 2c (2, 3): each register
        // pairs one dim of two keys, byte-permuted from the two keys' words.
#pragma unroll
        for (int n = 0; n < KS; ++n) {
            unsigned a[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const Words<VW>& lo = vr[2 * h];     // key 8h + 2c
                const Words<VW>& hi = vr[2 * h + 1];  // key 8h + 2c + 1
                if constexpr (FP8) {  // bytes 2(n % 2), + 1 of word n / 2: the tile's two dims
                    const int b = 2 * (n % 2);
                    const unsigned x = __byte_perm(lo.w[n / 2], hi.w[n / 2],
                                                   b | (b + 4) << 4 | (b + 1) << 8 | (b + 5) << 12);
                    a[2 * h] = e4m3x4_lo_to_f16x2(x);      // dim 2n (row g)
                    a[2 * h + 1] = e4m3x4_hi_to_f16x2(x);  // dim 2n + 1 (row g + 8)
                } else {  // word n: the tile's two dims
                    a[2 * h] = __byte_perm(lo.w[n], hi.w[n], 0x5410);
                    a[2 * h + 1] = __byte_perm(lo.w[n], hi.w[n], 0x7632);
                }
            }
            tc_mma<FP8>(o[n], a, pb);
        }
        if constexpr (PREFETCH) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int i = 0; i < NC; ++i) kr[h][i] = kn[h][i];
            }
#pragma unroll
            for (int x = 0; x < 4; ++x) vr[x] = vn[x];
        }
    }

    // A head's sum over its 8 lanes; then the warps merge through shared memory.
    float* so = w.smem_o + warp * TC_ROWS * TC_MAX_D;
    float* sml = w.smem_ml + warp * TC_ROWS * 2;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 4);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 8);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 16);
        const int r = 2 * c + e;
        if (r < w.rows) {
#pragma unroll
            for (int n = 0; n < KS; ++n) {
                so[r * TC_MAX_D + tc_out_dim<D>(n, 0, g)] = o[n][e];
                so[r * TC_MAX_D + tc_out_dim<D>(n, 1, g)] = o[n][2 + e];
            }
            if (g == 0) {
                sml[r * 2] = m[e];
                sml[r * 2 + 1] = l[e];
            }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < w.rows * D; idx += TC_THREADS) {
        const int r = idx / D, d = idx % D;
        float big = METRALE_NEG_INF;
#pragma unroll
        for (int v = 0; v < TC_WARPS; ++v) big = fmaxf(big, w.smem_ml[(v * TC_ROWS + r) * 2]);
        float sum = 0.0f, val = 0.0f;
        if (big != METRALE_NEG_INF) {
#pragma unroll
            for (int v = 0; v < TC_WARPS; ++v) {
                const float f = exp2f(w.smem_ml[(v * TC_ROWS + r) * 2] - big);  // 0 for an idle warp
                sum += w.smem_ml[(v * TC_ROWS + r) * 2 + 1] * f;
                val += w.smem_o[(v * TC_ROWS + r) * TC_MAX_D + d] * f;
            }
        }
        val *= w.v_scale;
        const long long head = w.head0 + r;
        if (w.part_o == nullptr) {
            w.out[head * D + d] = f32_to_bf16(sum > 0.0f ? val / sum : 0.0f);
        } else {
            const long long part = head * w.num_splits + w.split;
            w.part_o[part * D + d] = val;
            if (d == 0) {
                w.part_ml[part * 2] = big;
                w.part_ml[part * 2 + 1] = sum;
            }
        }
    }
}

template <bool FP8>
__device__ void decode_tc_entry(const bf16_t* q, const void* k_cache, const void* v_cache,
                                const int* block_tables, const int* seq_lens, bf16_t* out,
                                float* part_o, float* part_ml, const float* k_scale,
                                const float* v_scale, float scale, int num_q_heads, int num_kv_heads,
                                int head_dim, int max_blocks, int num_splits) {
    __shared__ float smem_o[TC_WARPS * TC_ROWS * TC_MAX_D];
    __shared__ float smem_ml[TC_WARPS * TC_ROWS * 2];
    const int b = blockIdx.y, chunk = blockIdx.z / num_splits, split = blockIdx.z % num_splits;
    const int len = seq_lens[b], per_split = split_keys(len, num_splits), begin = split * per_split;
    if (num_splits > 1 && begin >= len) return;  // the combine skips it
    const int group = num_q_heads / num_kv_heads;
    const TcWork w{q,
                   static_cast<const unsigned char*>(k_cache),
                   static_cast<const unsigned char*>(v_cache),
                   block_tables + (long long)b * max_blocks,
                   (long long)b * num_q_heads + (long long)blockIdx.x * group + chunk * TC_ROWS,
                   min(TC_ROWS, group - chunk * TC_ROWS),
                   num_kv_heads,
                   (int)blockIdx.x,
                   begin,
                   min(len, begin + per_split),
                   num_splits,
                   split,
                   FP8 ? scale * *k_scale : scale,
                   FP8 ? *v_scale : 1.0f,
                   out,
                   num_splits > 1 ? part_o : nullptr,
                   part_ml,
                   smem_o,
                   smem_ml};
    if (head_dim == 64) decode_tc<64, FP8>(w);
    else if (head_dim == 128) decode_tc<128, FP8>(w);
}

// Same arguments as paged_decode_attn (paged_decode.cu); grid = (Hk, B, chunks * num_splits) with
// chunks = ceil(group / TC_ROWS), block = TC_THREADS; head_dim 64 or 128. The split partials go
// to that module's paged_decode_combine (the same split rule and partial layout).
// Resident CTAs per SM: bf16 4 (112 registers), fp8 3 (its prefetch takes 142; at 4 it spills);
// the host mirrors them (cuda_ops.TC_CTAS_PER_SM) when it picks the split count.
#define METRALE_TC_ENTRY(name, fp8, min_ctas)                                                     \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, min_ctas)                           \
        name(const bf16_t* q, const void* k_cache, const void* v_cache, const int* block_tables, \
             const int* seq_lens, bf16_t* out, float* part_o, float* part_ml,                    \
             const float* k_scale, const float* v_scale, float scale, int num_q_heads,           \
             int num_kv_heads, int head_dim, int max_blocks, int num_splits) {                   \
        pdl_wait();                                                                              \
        pdl_launch_dependents();                                                                 \
        decode_tc_entry<fp8>(q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_ml,  \
                             k_scale, v_scale, scale, num_q_heads, num_kv_heads, head_dim,       \
                             max_blocks, num_splits);                                            \
    }
METRALE_TC_ENTRY(paged_decode_attn_tc, false, 4)
METRALE_TC_ENTRY(paged_decode_attn_tc_fp8, true, 3)
#undef METRALE_TC_ENTRY
