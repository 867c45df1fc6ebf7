// Projections of up to 16 rows (decode steps of 2 to 16 sequences, short chunks): y (M, N) =
// x (M, K) w (N, K)^T, bf16 in and out, fp32 sums on tensor cores, fed by a ring of 2-D tensor-map
// copies (TMA) in shared memory. cuBLAS runs these shapes at 2.6-3.6 TB/s (its split-K for
// o_proj adds a reduction launch); this kernel streams them at 3.2-4.1 TB/s on an H200
// (docs/performance.md, 2026-12-04).
//
// A CTA walks column tiles of NT * 16 weight rows (tile blockIdx.x, + gridDim.x, ...), the ring
// running on from one tile to the next. A stage is GR_KC elements of K: four 64-element boxes of
// the tile's rows and four of x's 16 rows (rows past M arrive as zeros), 128-byte swizzled. One
// lane of warp GR_CW (the producer) issues the copies, a tile's weight boxes of the first stages
// before the PDL wait (weights are constants), x's after it; consumer warp j takes box j of every
// stage with ldmatrix into m16n8k16 MMAs (weights as A, x as B), and the four warps' sums meet in
// shared memory at a tile's end, added in warp order: a row's outputs do not depend on the other
// rows. The host builds the tensor maps (CudaOps.linear) and picks NT and the stages
// (table.gemm_rows_variant, which leaves the shapes cuBLAS streams as fast to it).
//
// The SwiGLU entry runs a dense FFN's gate/up with its activation: w is [gate | up] (2I, K), a
// tile's 32 weight rows are 16 of gate and the same 16 of up (two boxes of 16 rows a 64-element
// step, stacked as one 32-row box), and its epilogue stores silu(gate) * up for those 16 of the I
// columns: the bytes of silu_and_mul_bf16 on the 2/4 variant's output, one launch and no (M, 2I)
// tensor.
#include "bulk_copy.cuh"
#include "mma.cuh"
#include "numeric.cuh"
#include "pdl.cuh"

#define GR_CW 4     // consumer warps: one 64-element box of a stage each
#define GR_KC 256   // a stage's K (K % GR_KC == 0)

// A CUtensorMap, passed by value (__grid_constant__) and read by the copies in place.
struct __align__(64) TensorMap {
    unsigned long long v[16];
};

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// The box of `map` at (c0 along K, c1 along rows) into shared memory at dst, counted on bar.
__device__ __forceinline__ void tma_box(unsigned dst, const TensorMap* map, int c0, int c1, unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(smem_addr(bar))
        : "memory");
}

__device__ __forceinline__ void bar_consumers() { asm volatile("bar.sync 1, %0;" ::"n"(GR_CW * 32)); }

// Byte offset of 16-byte chunk q of row r in a 128-byte swizzled box (the copies' layout).
__device__ __forceinline__ unsigned swizzled(int r, int q) { return r * 128 + ((q ^ (r & 7)) << 4); }

template <int NT, int STAGES, bool SWIGLU = false>
__device__ void gemm_rows(const TensorMap& wmap, const TensorMap& xmap, bf16_t* y, int m, int n, int k) {
    static_assert(!SWIGLU || NT == 2, "a SwiGLU tile is 16 rows of gate and 16 of up");
    constexpr int BR = NT * 16;                      // a tile's weight rows
    constexpr int WBOX = BR * 128, XBOX = 16 * 128;  // a box's bytes
    constexpr int STAGE = 4 * (WBOX + XBOX);
    extern __shared__ unsigned char smem[];
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);
    unsigned long long* empty = full + STAGES;
    float* red = reinterpret_cast<float*>(smem + 128);
    const unsigned ring = (smem_addr(smem + 128 + GR_CW * NT * 1024) + 1023u) & ~1023u;  // swizzled boxes: 1 KB aligned
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // n: the output's columns (SwiGLU: I, the weight holding 2I rows)
    const int tiles = SWIGLU ? (n + 15) / 16 : (n + BR - 1) / BR, chunks = k / GR_KC;
    const int mine = (int)blockIdx.x < tiles ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int total = mine * chunks;  // stages this CTA consumes
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], GR_CW);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == GR_CW) {  // the producer
        if (lane != 0) return;
        auto issue = [&](int it, bool weights, bool rows) {
            const int s = it % STAGES, tile = blockIdx.x + (it / chunks) * gridDim.x, k0 = (it % chunks) * GR_KC;
            const unsigned base = ring + s * STAGE;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                if (weights && SWIGLU) {  // wmap's boxes are 16 rows: gate's, then up's below them
                    tma_box(base + b * WBOX, &wmap, k0 + 64 * b, tile * 16, &full[s]);
                    tma_box(base + b * WBOX + 16 * 128, &wmap, k0 + 64 * b, n + tile * 16, &full[s]);
                } else if (weights) {
                    tma_box(base + b * WBOX, &wmap, k0 + 64 * b, tile * BR, &full[s]);
                }
                if (rows) tma_box(base + 4 * WBOX + b * XBOX, &xmap, k0 + 64 * b, 0, &full[s]);
            }
        };
        const int first = min(STAGES, total);
        for (int it = 0; it < first; ++it) {
            mbar_expect(&full[it], STAGE);  // whole boxes, their rows past N or M as zeros
            issue(it, true, false);
        }
        pdl_wait();
        pdl_launch_dependents();
        for (int it = 0; it < first; ++it) issue(it, false, true);
        for (int it = STAGES; it < total; ++it) {
            const int s = it % STAGES;
            mbar_wait(&empty[s], ((it / STAGES) - 1) & 1);
            mbar_expect(&full[s], STAGE);
            issue(it, true, true);
        }
        return;
    }
    pdl_wait();
    pdl_launch_dependents();
    // ldmatrix rows: A (weights) matrices rows 0-7 / 8-15 x chunks 2j / 2j + 1; B (x) rows 0-7 /
    // 8-15 (tokens) x the same chunks, in the MMA's register order.
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_hi = lane >> 4;
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_hi = (lane >> 3) & 1;
    float acc[NT][2][4] = {};
    for (int it = 0; it < total; ++it) {
        const int s = it % STAGES;
        const unsigned wbox = ring + s * STAGE + warp * WBOX, xbox = ring + s * STAGE + 4 * WBOX + warp * XBOX;
        mbar_wait(&full[s], (it / STAGES) & 1);
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // K 16j .. 16j + 15 of the box
            unsigned b[4];
            ldsm_x4(b, xbox + swizzled(b_row, 2 * j + b_hi));
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                unsigned a[4];
                ldsm_x4(a, wbox + swizzled(16 * t + a_row, 2 * j + a_hi));
                const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                mma_bf16_16816(acc[t][0], a, b0);  // tokens 0-7
                mma_bf16_16816(acc[t][1], a, b1);  // tokens 8-15
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
        if (it % chunks == chunks - 1) {  // the tile's sums, in warp order
            const int n0 = (blockIdx.x + (it / chunks) * gridDim.x) * BR;
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        red[(warp * NT * 8 + (t * 2 + h) * 4 + i) * 32 + lane] = acc[t][h][i];
                        acc[t][h][i] = 0.0f;
                    }
            bar_consumers();
            if (SWIGLU) {
                const int c0 = (blockIdx.x + (it / chunks) * gridDim.x) * 16;
                for (int e = threadIdx.x; e < 256; e += GR_CW * 32) {  // gate's sums at e, up's at 256 + e
                    float gate = 0.0f, up = 0.0f;
#pragma unroll
                    for (int v = 0; v < GR_CW; ++v) gate += red[v * 512 + e], up += red[v * 512 + 256 + e];
                    const int l = e & 31, i = (e >> 5) & 3, h = (e >> 7) & 1;
                    const int col = c0 + (l >> 2) + (i >= 2 ? 8 : 0), row = 8 * h + 2 * (l & 3) + (i & 1);
                    if (row < m && col < n)
                        y[(long long)row * n + col] = f32_to_bf16(silu_mul(round_bf16(gate), round_bf16(up)));
                }
                bar_consumers();
                continue;
            }
            for (int e = threadIdx.x; e < NT * 256; e += GR_CW * 32) {
                float sum = 0.0f;
#pragma unroll
                for (int v = 0; v < GR_CW; ++v) sum += red[v * NT * 256 + e];
                // e: lane l of fragment register i of tile t, tokens 8h ..: row g (+ 8), column 2c (+ 1)
                const int l = e & 31, i = (e >> 5) & 3, h = (e >> 7) & 1, t = e >> 8;
                const int col = n0 + 16 * t + (l >> 2) + (i >= 2 ? 8 : 0), row = 8 * h + 2 * (l & 3) + (i & 1);
                if (row < m && col < n) y[(long long)row * n + col] = f32_to_bf16(sum);
            }
            bar_consumers();  // red is read before the next tile writes it
        }
    }
}

// wmap: w (N, K) bf16, boxes of 64 x NT * 16; xmap: x (M, K) bf16, boxes of 64 x 16; both 128-byte
// swizzled. y (M, N) bf16. M <= 16, K % GR_KC == 0. block (GR_CW + 1) * 32; dynamic shared memory
// 128 + GR_CW * NT * 1024 + 1024 + STAGES * 4 * (NT * 16 + 16) * 128 bytes (table.gemm_rows_shared).
#define GEMM_ROWS_ENTRY(NT, S)                                                                                    \
    extern "C" __global__ void __launch_bounds__((GR_CW + 1) * 32) gemm_rows_bf16_t##NT##_s##S(                 \
        const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap, bf16_t* y, int m, int n, \
        int k) {                                                                                                  \
        gemm_rows<NT, S>(wmap, xmap, y, m, n, k);                                                                 \
    }

GEMM_ROWS_ENTRY(1, 4)
GEMM_ROWS_ENTRY(2, 4)
GEMM_ROWS_ENTRY(2, 6)

// w: [gate | up] (2I, K) with boxes of 64 x 16 rows; y (M, I) = silu(x gate^T) * (x up^T), each
// rounded to bf16 first; n = I, a multiple of 16. Launched as the 2/4 variant.
extern "C" __global__ void __launch_bounds__((GR_CW + 1) * 32) gemm_rows_swiglu_bf16(
    const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap, bf16_t* y, int m, int n, int k) {
    gemm_rows<2, 4, true>(wmap, xmap, y, m, n, k);
}
