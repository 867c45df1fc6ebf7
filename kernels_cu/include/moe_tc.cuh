// The tensor-core pieces of the MoE expert kernels (moe.cu's and moe_down_smem.cu's): a lane's
// share of a 64-element K block, the MMA work of a CTA's weight tiles, the warps' reduction, and
// where an expert's (or a shared expert chunk's) weight rows are.
#pragma once
#include "gemv.cuh"
#include "mma.cuh"

// The expert kernels' dot products run on tensor cores. A CTA takes 16 weight rows of its expert
// (16 columns of its width for gate/up, of hidden for down) and every pair that chose the expert,
// a pass of up to MOE_TC_PAIRS pairs at a time; its MOE_TC_WARPS warps split the K dimension in blocks of 64 (warp w: blocks w, w + 4, ..)
// and warp 0 adds their sums in warp order. A warp's m16n8k16 step: A = 16 weight rows, B = 8
// pairs' input rows. Lane 4g + c loads the 16 elements 16c .. 16c + 15 of a 64-element block of
// weight rows g and g + 8 and of pair g's input row; its four steps of the block take elements
// 4i .. 4i + 3 of those (logical k 2c, 2c + 1, 2c + 8, 2c + 9 of step i): a permutation of K that
// A and B share, so the loads stay 16 bytes wide and no operand is shuffled.
#define MOE_TC_WARPS 4
#define MOE_TC_THREADS (MOE_TC_WARPS * 32)
#define MOE_TC_ROWS 16  // weight rows (output columns) per CTA
#define MOE_TC_NT 2  // 8-pair tiles per pass
#define MOE_TC_PAIRS (8 * MOE_TC_NT)

struct Block16 {  // a lane's 16 elements of a 64-element K block: two 16-byte chunks
    Chunk c[2];
};

__device__ __forceinline__ Block16 load_block(const bf16_t* row, int k0, int kdim, bool valid, bool stream) {
    Block16 b;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int k = k0 + 8 * h;
        if (valid && k < kdim) b.c[h] = stream ? load_weights(row + k) : *reinterpret_cast<const Chunk*>(row + k);
        else b.c[h] = Chunk{{0u, 0u, 0u, 0u}};
    }
    return b;
}

// Words 2i and 2i + 1 of the lane's 16 elements: step i's k pairs (2c, 2c + 1) and (2c + 8, 2c + 9).
__device__ __forceinline__ unsigned block_word(const Block16& b, int w) { return b.c[w >> 2].w[w & 3]; }

// TILES weight tiles of 16 rows share the B operand (gate/up: the gate rows and the up rows).
template <int TILES>
struct TcWork {
    const bf16_t* w;     // the expert's weight rows: ld elements apart, the first wk of each read
    const bf16_t* in;    // input rows (kdim elements each)
    const int* pairs;
    int row0[TILES];     // first weight row of each tile
    int rows_valid;      // weight rows of a tile in range: j0 + g < n
    int j0, n, kdim, ld, wk, top_k, lo, hi;
    bool input_by_row;   // gate/up: a pair's input is row q / top_k of `in`; down: row q

    // This lane's share of weight block kb (the A operand), as pass loads it: rows g and g + 8 of
    // each tile, 16 elements of the block; zeros past the rows in range, nothing read past the last
    // block.
    __device__ void load_a(Block16 (&a)[TILES][2], int kb) const {
        const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
        const int blocks = (kdim + 63) / 64, k0 = kb * 64 + 16 * c;
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                a[t][h] = load_block(w + (long long)(row0[t] + g + 8 * h) * ld, k0, wk,
                                     kb < blocks && g + 8 * h < rows_valid, true);
    }

    // acc[t][nt][4]: the sums over K blocks part, part + MOE_TC_WARPS, .. (the CTA's warp by
    // default) for the pass's pairs [base, base + MOE_TC_PAIRS). The weight blocks are a ring of
    // DEPTH in registers: block i + DEPTH - 1's loads are issued before block i's MMAs, so a warp
    // has DEPTH - 1 blocks in flight while it multiplies (DEPTH 1: load, then multiply). The sums'
    // order is the same for every DEPTH.
    template <int DEPTH>
    __device__ void pass(int base, float (&acc)[TILES][MOE_TC_NT][4], int part = threadIdx.x >> 5) const {
        Block16 none[TILES][2];
        pass<DEPTH>(base, acc, part, none, false);
    }

    // The same with block `part` as load_a loaded it earlier (before a PDL wait) into `first`,
    // where `loaded` (DEPTH 1), not loaded again.
    template <int DEPTH>
    __device__ void pass(int base, float (&acc)[TILES][MOE_TC_NT][4], int part, const Block16 (&first)[TILES][2],
                         bool loaded) const {
        const int lane = threadIdx.x & 31, warp = part, g = lane >> 2, c = lane & 3;
        const int blocks = (kdim + 63) / 64;
        const int npairs = min(MOE_TC_PAIRS, hi - base);
        const bf16_t* xrow[MOE_TC_NT];
#pragma unroll
        for (int nt = 0; nt < MOE_TC_NT; ++nt) {
            const int p = base + nt * 8 + g;
            const int q = p < hi ? pairs[p] : 0;
            xrow[nt] = p < hi ? in + (long long)(input_by_row ? q / top_k : q) * kdim : nullptr;
        }
        const bf16_t* wrow[TILES][2];
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) wrow[t][h] = w + (long long)(row0[t] + g + 8 * h) * ld;
        const bool valid[2] = {g < rows_valid, g + 8 < rows_valid};
        auto load = [&](Block16 (&a)[TILES][2], int kb) {  // nothing is read past the last block
            const int k0 = kb * 64 + 16 * c;
#pragma unroll
            for (int t = 0; t < TILES; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h) a[t][h] = load_block(wrow[t][h], k0, wk, kb < blocks && valid[h], true);
        };
        auto multiply = [&](const Block16 (&a)[TILES][2], int kb) {
            const int k0 = kb * 64 + 16 * c;
#pragma unroll
            for (int nt = 0; nt < MOE_TC_NT; ++nt) {
                if (nt * 8 >= npairs) continue;  // warp-uniform
                const Block16 b = load_block(xrow[nt], k0, kdim, xrow[nt] != nullptr, false);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const unsigned bw[2] = {block_word(b, 2 * i), block_word(b, 2 * i + 1)};
#pragma unroll
                    for (int t = 0; t < TILES; ++t) {
                        const unsigned aw[4] = {block_word(a[t][0], 2 * i), block_word(a[t][1], 2 * i),
                                                block_word(a[t][0], 2 * i + 1), block_word(a[t][1], 2 * i + 1)};
                        mma_bf16_16816(acc[t][nt], aw, bw);
                    }
                }
            }
        };
        Block16 a[DEPTH][TILES][2];
#pragma unroll
        for (int s = 0; s < DEPTH - 1; ++s) load(a[s], warp + s * MOE_TC_WARPS);
        for (int kb0 = warp; kb0 < blocks; kb0 += DEPTH * MOE_TC_WARPS) {
#pragma unroll
            for (int s = 0; s < DEPTH; ++s) {  // ring slots by constant index: they stay in registers
                const int kb = kb0 + s * MOE_TC_WARPS;
                if (DEPTH == 1 && loaded && kb == warp) {
#pragma unroll
                    for (int t = 0; t < TILES; ++t) a[0][t][0] = first[t][0], a[0][t][1] = first[t][1];
                } else {
                    load(a[(s + DEPTH - 1) % DEPTH], kb + (DEPTH - 1) * MOE_TC_WARPS);
                }
                if (kb < blocks) multiply(a[s], kb);
            }
        }
    }
};

// The warps' sums added in warp order into warp 0's acc (the other warps' acc are left as they were).
template <int TILES>
__device__ void tc_reduce(float (&acc)[TILES][MOE_TC_NT][4], float* red) {
    constexpr int N = TILES * MOE_TC_NT * 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp > 0) {
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int nt = 0; nt < MOE_TC_NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) red[((warp - 1) * N + (t * MOE_TC_NT + nt) * 4 + i) * 32 + lane] = acc[t][nt][i];
    }
    __syncthreads();
    if (warp == 0) {
        for (int w = 1; w < MOE_TC_WARPS; ++w)
#pragma unroll
            for (int t = 0; t < TILES; ++t)
#pragma unroll
                for (int nt = 0; nt < MOE_TC_NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        acc[t][nt][i] += red[((w - 1) * N + (t * MOE_TC_NT + nt) * 4 + i) * 32 + lane];
    }
    __syncthreads();  // red is free for the next pass
}

// Where expert e's weights are: a routed expert's in the stacked tensors; the shared expert's chunk
// c = e - (E - chunks) in its own (2W, H) gate/up = [gate; up] and (H, W) down, its rows or
// columns [cI, cI + I) (fewer in the last chunk: `valid`, the rest read as zeros).
struct ExpertRows {
    const bf16_t* w;  // gate/up: the gate rows; down: the first column of row 0
    int up;           // gate/up: the up rows' offset from the gate rows, in rows
    int ld;           // down: elements between rows
    int valid;        // rows (gate/up) or columns (down) of the chunk that exist
};

__device__ __forceinline__ ExpertRows gate_up_rows(const bf16_t* gate_up, const bf16_t* shared, int e, int num_experts,
                                                   int hidden, int inter, int shared_width) {
    const int chunks = (shared_width + inter - 1) / inter, c = e - (num_experts - chunks);
    if (c < 0) return {gate_up + (long long)e * 2 * inter * hidden, inter, hidden, inter};
    return {shared + (long long)c * inter * hidden, shared_width, hidden, min(inter, shared_width - c * inter)};
}

__device__ __forceinline__ ExpertRows down_rows(const bf16_t* down, const bf16_t* shared, int e, int num_experts,
                                                int hidden, int inter, int shared_width) {
    const int chunks = (shared_width + inter - 1) / inter, c = e - (num_experts - chunks);
    if (c < 0) return {down + (long long)e * hidden * inter, 0, inter, inter};
    return {shared + (long long)c * inter, 0, shared_width, min(inter, shared_width - c * inter)};
}
