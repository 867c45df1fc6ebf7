// Tensor-core paged decode attention for the bf16 and fp8 caches at head_dim 64 and 128.
// paged_decode.cu serves every other case (and every other dtype).
//
// A CTA owns up to 8 query heads of one KV head's group (a larger group takes several CTAs, which
// read the same K/V, mostly from L2), one sequence and one split of its context; its TC_WARPS
// warps take 16-key tiles in turn (a tile is one cache block: splits start at multiples of 16
// keys). Both products are m16n8k16 MMAs with the heads as the 8-wide N side:
//   S^T = K Q^T     A = 16 keys x 16 dims of K, B = q: one MMA per 16 dims,
//   O^T += V^T P^T  A = 16 dims x 16 keys of V, B = P: one MMA per 16 output dims.
// Each lane loads its operands straight from the cache with 16-byte loads, no shared memory:
// lane 4g + c reads keys g and g + 8, their 16-byte chunks c, c + 4, c + 8, ... (the 4 lanes of a
// key read 64 contiguous bytes). As loaded these are K's A fragments, with the MMAs' head_dim
// index a permutation of the dims (q is loaded through the same one: tc_dim). V's chunks become
// A fragments by movmatrix (8x8 transposes): the output's rows come out permuted and are stored
// by tc_out_dim. S^T's registers hold 2 heads x 2 keys per lane; packed and transposed, they are
// P's B fragment. The online softmax runs per warp in the log2 domain (a head's 8 lanes exchange
// maxima by three shuffles); the warps merge through shared memory, into the final output or a
// split's partial (max, sum, unnormalised output), which paged_decode_combine<suffix> reduces.
//
// bf16 cache: bf16 MMAs, q as stored, P rounded to bf16. fp8 cache: e4m3 converts exactly to f16,
// so the MMAs are f16 ones: q is scaled by a power of two into f16's range (undone on the
// scores), P rounded to f16; k_scale scales the scores and v_scale the output. A head's sum uses
// its P as rounded, so the output is exactly a weighted mean of the V rows read.
#include "mma.cuh"
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

// The dim of output element (tile n, half r, lane group g): column g of the transposed 8x8 V
// block that is A rows 8r + g of tile n (its register r, from chunk i's word or f16 pair y).
template <bool FP8>
__device__ __forceinline__ int tc_out_dim(int n, int r, int g) {
    constexpr int E = TcElems<FP8>::value;
    const int pair = 2 * n + r;  // f16/bf16 pair index within the lane's share: chunk i, pair y
    const int i = pair / (E / 2), y = pair % (E / 2);
    return (4 * i + g / 2) * E + 2 * y + g % 2;
}

template <int D, bool FP8>
__device__ void decode_tc(const TcWork& w) {
    constexpr int E = TcElems<FP8>::value;
    constexpr int BYTES = FP8 ? 1 : 2;  // per cache element
    constexpr int NC = D / (4 * E);     // 16-byte chunks of a key row per lane
    constexpr int KS = D / 16;          // MMA steps over head_dim (S^T) and output tiles (O^T)
    // A warp's iteration loads TILES tiles before scoring the first: an fp8 tile is half a bf16
    // one's bytes, and two keep as many bytes in flight.
    constexpr int TILES = FP8 ? 2 : 1;
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

    for (int first = w.begin + 16 * TILES * warp; first < w.end; first += 16 * TILES * TC_WARPS) {
        Words<4> krs[TILES][2][NC], vrs[TILES][2][NC];
#pragma unroll
        for (int u = 0; u < TILES; ++u) {
            const int tile = first + 16 * u;
            if (tile >= w.end) break;  // uniform across the warp
            const long long block = w.block_table[tile / ATTN_BLOCK];
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // key tile + 8h + g of this lane; a dead key's slot is
                // still inside the block: its K is masked below, its V zeroed (NaN-safe).
                const long long row = (block * ATTN_BLOCK + 8 * h + g) * w.num_kv_heads + w.kv_head;
                const unsigned char* kp = w.k_cache + row * (D * BYTES) + c * 16;
                const unsigned char* vp = w.v_cache + row * (D * BYTES) + c * 16;
#pragma unroll
                for (int i = 0; i < NC; ++i) {
                    krs[u][h][i] = *reinterpret_cast<const Words<4>*>(kp + 64 * i);
                    vrs[u][h][i] = *reinterpret_cast<const Words<4>*>(vp + 64 * i);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < TILES; ++u) {
            const int tile = first + 16 * u;
            if (tile >= w.end) break;
            auto& kr = krs[u];
            auto& vr = vrs[u];
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
            for (int h = 0; h < 2; ++h) {
                if (tile + 8 * h + g >= w.end) {
#pragma unroll
                    for (int i = 0; i < NC; ++i) vr[h][i].w[0] = vr[h][i].w[1] = vr[h][i].w[2] = vr[h][i].w[3] = 0u;
                }
            }
            // V^T as the A operand: word x of chunk i holds dims (4i + c) E + 2x, + 1 of key 8h + g
            // (two f16 pairs from an fp8 word); transposed, 8 keys of 8 dims. Output tile n takes
            // two such 8-dim groups: rows g (dims tc_out_dim(n, 0, g)) and g + 8 (.., 1, g).
#pragma unroll
            for (int n = 0; n < KS; ++n) {
                unsigned a[4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if constexpr (FP8) {
                        const unsigned x = vr[h][n / 4].w[n % 4];
                        a[2 * h] = movmatrix_trans(e4m3x4_lo_to_f16x2(x));
                        a[2 * h + 1] = movmatrix_trans(e4m3x4_hi_to_f16x2(x));
                    } else {
                        a[2 * h] = movmatrix_trans(vr[h][n / 2].w[(n % 2) * 2]);
                        a[2 * h + 1] = movmatrix_trans(vr[h][n / 2].w[(n % 2) * 2 + 1]);
                    }
                }
                tc_mma<FP8>(o[n], a, pb);
            }
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
                so[r * TC_MAX_D + tc_out_dim<FP8>(n, 0, g)] = o[n][e];
                so[r * TC_MAX_D + tc_out_dim<FP8>(n, 1, g)] = o[n][2 + e];
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
#define METRALE_TC_ENTRY(name, fp8)                                                               \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, 3)                                  \
        name(const bf16_t* q, const void* k_cache, const void* v_cache, const int* block_tables, \
             const int* seq_lens, bf16_t* out, float* part_o, float* part_ml,                    \
             const float* k_scale, const float* v_scale, float scale, int num_q_heads,           \
             int num_kv_heads, int head_dim, int max_blocks, int num_splits) {                   \
        decode_tc_entry<fp8>(q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_ml,  \
                             k_scale, v_scale, scale, num_q_heads, num_kv_heads, head_dim,       \
                             max_blocks, num_splits);                                            \
    }
METRALE_TC_ENTRY(paged_decode_attn_tc, false)
METRALE_TC_ENTRY(paged_decode_attn_tc_fp8, true)
#undef METRALE_TC_ENTRY
