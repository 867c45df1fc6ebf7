// The end of a decode step in one launch: each row's greedy token and the static buffers of the
// next step (cuda_graphs.DecodeGraphs), in place of torch's argmax, a token copy and the dozen
// small kernels that move positions, context lengths and cache slots on.
//
// Row r's token is the first index of the largest logit, as torch.argmax: a NaN counts as larger
// than any number, and -0.0 equals +0.0. A CTA takes a slice of a row and leaves the best
// (value, index) of its slice as one 64-bit key; the row's last CTA to finish (a counter per row,
// a fence on either side of its atomic, as in paged_decode_tc.cu) reduces the keys and advances
// the row.
#include "numeric.cuh"
#include "reduce.cuh"

#define STEP_THREADS 256
#define STEP_MAX_SLICES 128
#define STEP_BLOCK 16  // tokens per cache block (kernels/ops.BLOCK_SIZE)

// Larger key = larger value, then smaller index.
__device__ __forceinline__ unsigned long long argmax_key(float v, int index) {
    unsigned bits = __float_as_uint(v);
    if (v != v) bits = 0xffffffffu;               // NaN: above +inf
    else if (v == 0.0f) bits = 0x80000000u;       // -0.0 as +0.0
    else bits = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
    return ((unsigned long long)bits << 32) | (0xffffffffu - (unsigned)index);
}

__device__ __forceinline__ unsigned long long max_key(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}

// Row r moves on by one position when live: the token becomes its input, its position and
// context length grow by one, and its cache slot is the new position's place in its block table
// (a finished row may point one block past its table: the index is clamped, the slot unused).
__device__ void advance_row(int r, long long token, long long* tokens, int* positions, int* seq_lens,
                            int* slots, const int* live, const int* tables, int max_blocks) {
    tokens[r] = token;
    const int step = live[r];
    const int pos = positions[r] + step;
    positions[r] = pos;
    seq_lens[r] += step;
    const int block = tables[(long long)r * max_blocks + min(pos / STEP_BLOCK, max_blocks - 1)];
    slots[r] = step ? block * STEP_BLOCK + pos % STEP_BLOCK : -1;
}

// logits: (rows, vocab) fp32, or null when the tokens were sampled already (then next_tokens
// holds them). next_tokens, tokens: (rows,) int64; positions, seq_lens, slots, live: (rows,)
// int32; tables: (rows, max_blocks) int32. keys: rows * STEP_MAX_SLICES words of scratch;
// counters: rows zeroed words (each launch leaves them zero). With logits, next_tokens[r] receives
// row r's greedy token. grid = (slices, rows), slices <= STEP_MAX_SLICES (1 without logits);
// block = STEP_THREADS.
extern "C" __global__ void __launch_bounds__(STEP_THREADS)
    decode_advance(const float* logits, int vocab, long long* next_tokens, long long* tokens, int* positions,
                   int* seq_lens, int* slots, const int* live, const int* tables, int max_blocks,
                   unsigned long long* keys, unsigned* counters) {
    const int r = blockIdx.y, slices = gridDim.x, t = threadIdx.x;
    if (logits == nullptr) {
        if (t == 0) advance_row(r, next_tokens[r], tokens, positions, seq_lens, slots, live, tables, max_blocks);
        return;
    }
    const int per = (vocab + slices - 1) / slices, begin = blockIdx.x * per, end = min(vocab, begin + per);
    const float* row = logits + (long long)r * vocab;
    unsigned long long best = 0;  // below every key of an index < 2^32 - 1
#pragma unroll 8
    for (int i = begin + t; i < end; i += STEP_THREADS) best = max_key(best, argmax_key(row[i], i));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max_key(best, __shfl_xor_sync(0xffffffffu, best, o));
    __shared__ unsigned long long warp_best[STEP_THREADS / 32];
    __shared__ bool is_last;
    if ((t & 31) == 0) warp_best[t >> 5] = best;
    __syncthreads();
    if (t == 0) {
        for (int w = 1; w < STEP_THREADS / 32; ++w) best = max_key(best, warp_best[w]);
        keys[(long long)r * STEP_MAX_SLICES + blockIdx.x] = best;
        is_last = last_arrival(counters + r, (unsigned)slices);
    }
    __syncthreads();
    if (!is_last || t >= 32) return;
    // The row's last CTA: warp 0 reduces the slices' keys (lane l reads keys l, l + 32, ...).
    const volatile unsigned long long* row_keys = keys + (long long)r * STEP_MAX_SLICES;
    best = 0;
    for (int s = t; s < slices; s += 32) best = max_key(best, row_keys[s]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max_key(best, __shfl_xor_sync(0xffffffffu, best, o));
    if (t != 0) return;
    const long long token = (long long)(0xffffffffu - (unsigned)(best & 0xffffffffu));
    next_tokens[r] = token;
    advance_row(r, token, tokens, positions, seq_lens, slots, live, tables, max_blocks);
}
