// The pieces of the batch-1 decode GEMVs shared by gemv.cu and decode_stack.cu: 16-byte weight
// chunks, their dot products with the activation row, and the row's staging in shared memory
// (with add_rms_norm_bf16's arithmetic when normalized).
#pragma once
#include "reduce.cuh"
#include "rms_row.cuh"

#define GEMV_THREADS 256
#define GEMV_WARPS (GEMV_THREADS / 32)
#define GEMV_MAX_K 20480  // x is staged in shared memory as bf16: 40 KB (FFN widths up to 20480: 17408 is Qwen3-14B's and Qwen3.5-27B's)

typedef Words<4> Chunk;  // 8 bf16

__device__ __forceinline__ Chunk load_weights(const bf16_t* p) {
#ifdef METRALE_HOST_EMULATION
    return *reinterpret_cast<const Chunk*>(p);
#else
    // Streamed once per token: read-only path, not kept in L1.
    Chunk c;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(c.w[0]), "=r"(c.w[1]), "=r"(c.w[2]), "=r"(c.w[3])
        : "l"(p));
    return c;
#endif
}

__device__ __forceinline__ float dot8(const Chunk& w, const Chunk& x, float acc) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc = __fmaf_rn(__uint_as_float(w.w[i] << 16), __uint_as_float(x.w[i] << 16), acc);
        acc = __fmaf_rn(__uint_as_float(w.w[i] & 0xffff0000u), __uint_as_float(x.w[i] & 0xffff0000u), acc);
    }
    return acc;
}

// A bf16 row in global memory as stage_row's source.
struct BfRow {
    const bf16_t* p;
    __device__ void operator()(int i, float* a) const { load_vec<8>(p + i, a); }  // elements i .. i + 7
    __device__ Chunk chunk(int i) const { return *reinterpret_cast<const Chunk*>(p + i); }
};

// A row times sigmoid(gate) as stage_row's source: torch's ``x * torch.sigmoid(g)`` on bf16 tensors
// (the sigmoid rounded to bf16, then the product), a gated attention's output before o_proj.
struct GatedRow {
    const bf16_t* p;
    const bf16_t* g;
    __device__ void operator()(int i, float* a) const {
        float s[8];
        load_vec<8>(p + i, a);
        load_vec<8>(g + i, s);
#pragma unroll
        for (int j = 0; j < 8; ++j) a[j] = round_bf16(a[j] * round_bf16(1.0f / (1.0f + expf(-s[j]))));
    }
    __device__ Chunk chunk(int i) const {
        float a[8];
        (*this)(i, a);
        Chunk c;
        store_vec<8>(reinterpret_cast<bf16_t*>(&c), a);
        return c;
    }
};

// The threads that stage a row of k elements: with the norm, add_rms_norm_bf16's block size.
template <bool NORM>
__device__ __forceinline__ int stage_threads(int k) {
    return NORM && k < 2048 ? 128 : GEMV_THREADS;
}

// A thread's first STAGE_EARLY chunks of the norm's weight, loaded before the PDL wait (a
// constant): the prologue after the wait then reads only the activation.
#define STAGE_EARLY 2
struct EarlyGamma {
    Chunk c[STAGE_EARLY];
};

template <bool NORM>
__device__ __forceinline__ EarlyGamma early_gamma(const bf16_t* gamma, int k) {
    EarlyGamma g;
    const int threads = stage_threads<NORM>(k), t = threadIdx.x;
#pragma unroll
    for (int e = 0; e < STAGE_EARLY; ++e) {
        const int i = (t + e * threads) * 8;
        if (NORM && t < threads && i < k) g.c[e] = *reinterpret_cast<const Chunk*>(gamma + i);
    }
    return g;
}

// Stage the activation row (read through `src`, see BfRow) in shared memory. With ``gamma`` it is
// add_rms_norm_bf16's output (s = bf16(x + residual), written to sum_out by CTA 0; then
// bf16(gamma * bf16(s * r))): threads below rmsnorm's block size cover the elements that thread
// covers there, so the sums match. A thread's first STAGE_EARLY chunks are loaded together, and
// their weights come from ``early`` where given. Run by GEMV_THREADS threads.
template <bool NORM, class Src>
__device__ void stage_row(Chunk* xs, const Src& src, const bf16_t* residual, const bf16_t* gamma,
                          bf16_t* sum_out, int k, float eps, const EarlyGamma* early = nullptr) {
    const int threads = stage_threads<NORM>(k);
    const int t = threadIdx.x;
    if (!NORM) {
        for (int i = t * 8; i < k; i += threads * 8) xs[i / 8] = src.chunk(i);
        CTA_SYNC();
        return;
    }
    // Chunk e of this thread: elements (t + e * threads) * 8 .. + 7, summed in that order.
    auto sum_chunk = [&](int i, float* a, const float* b) {
        if (residual != nullptr) {
#pragma unroll
            for (int j = 0; j < 8; ++j) a[j] = round_bf16(a[j] + b[j]);
            if (sum_out != nullptr && blockIdx.x == 0) store_vec<8>(sum_out + i, a);
        }
        store_vec<8>(reinterpret_cast<bf16_t*>(xs + i / 8), a);
    };
    float ss = 0.0f;
    if (t < threads) {
        float a[STAGE_EARLY][8], b[STAGE_EARLY][8];
#pragma unroll
        for (int e = 0; e < STAGE_EARLY; ++e) {
            const int i = (t + e * threads) * 8;
            if (i < k) {
                src(i, a[e]);
                if (residual != nullptr) load_vec<8>(residual + i, b[e]);
            }
        }
#pragma unroll
        for (int e = 0; e < STAGE_EARLY; ++e) {
            const int i = (t + e * threads) * 8;
            if (i < k) {
                sum_chunk(i, a[e], b[e]);
                ss = add_squares<8>(ss, a[e]);
            }
        }
        for (int i = (t + STAGE_EARLY * threads) * 8; i < k; i += threads * 8) {
            float x[8], y[8];
            src(i, x);
            if (residual != nullptr) load_vec<8>(residual + i, y);
            sum_chunk(i, x, y);
            ss = add_squares<8>(ss, x);
        }
    }
    const float r = inv_rms(block_sum(ss), k, eps);  // block_sum's barrier orders xs too
    if (t < threads) {
        auto scale_chunk = [&](int i, const float* g) {
            float a[8];
            load_vec<8>(reinterpret_cast<const bf16_t*>(xs + i / 8), a);
#pragma unroll
            for (int j = 0; j < 8; ++j) a[j] = rms_scaled(a[j], g[j], r);
            store_vec<8>(reinterpret_cast<bf16_t*>(xs + i / 8), a);
        };
#pragma unroll
        for (int e = 0; e < STAGE_EARLY; ++e) {
            const int i = (t + e * threads) * 8;
            if (i < k) {
                float g[8];
                if (early != nullptr) load_vec<8>(reinterpret_cast<const bf16_t*>(&early->c[e]), g);
                else load_vec<8>(gamma + i, g);
                scale_chunk(i, g);
            }
        }
        for (int i = (t + STAGE_EARLY * threads) * 8; i < k; i += threads * 8) {
            float g[8];
            load_vec<8>(gamma + i, g);
            scale_chunk(i, g);
        }
    }
    CTA_SYNC();
}

template <bool NORM>
__device__ void stage_x(Chunk* xs, const bf16_t* x, const bf16_t* residual, const bf16_t* gamma,
                        bf16_t* sum_out, int k, float eps, const EarlyGamma* early = nullptr) {
    stage_row<NORM>(xs, BfRow{x}, residual, gamma, sum_out, k, eps, early);
}
