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
#include "decode_tc.cuh"
#include "pdl.cuh"

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
    const long long head0 = (long long)b * num_q_heads + (long long)blockIdx.x * group + chunk * TC_ROWS;
    const TcWork w{q + head0 * head_dim,
                   static_cast<const unsigned char*>(k_cache),
                   static_cast<const unsigned char*>(v_cache),
                   block_tables + (long long)b * max_blocks,
                   head0,
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
