// RMSNorm, HF rounding order: y = bf16(x * rsqrt(mean(x^2) + eps)); out = bf16(w * y).
// One block per row; 8-wide vector loads when the row allows it. The per-element arithmetic is
// rms_row.cuh's, shared with the fused QK-norm of rope_and_cache.cu.
// Both launch programmatically (pdl.cuh): the projection after a norm loads its first weights
// while the norm runs.
#include "pdl.cuh"
#include "reduce.cuh"
#include "rms_row.cuh"

template <int V>
__device__ float row_sum_squares(const bf16_t* x, int hidden) {
    float ss = 0.0f;
    for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
        float f[V];
        load_vec<V>(x + i, f);
        ss = add_squares<V>(ss, f);
    }
    return block_sum(ss);
}

template <int V>
__device__ void row_normalize(const bf16_t* s, const bf16_t* w, bf16_t* out, int hidden, float r) {
    for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
        float f[V], g[V];
        load_vec<V>(s + i, f);
        load_vec<V>(w + i, g);
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = rms_scaled(f[j], g[j], r);
        store_vec<V>(out + i, f);
    }
}

// s = bf16(x + residual) written to sum_out; returns sum(s^2) over the row.
template <int V>
__device__ float row_add(const bf16_t* x, const bf16_t* res, bf16_t* sum_out, int hidden) {
    float ss = 0.0f;
    for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
        float a[V], b[V];
        load_vec<V>(x + i, a);
        load_vec<V>(res + i, b);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            a[j] = round_bf16(a[j] + b[j]);
            ss += a[j] * a[j];
        }
        store_vec<V>(sum_out + i, a);
    }
    return block_sum(ss);
}

__device__ __forceinline__ bool vec8_ok(int hidden, const void* a, const void* b, const void* c,
                                        const void* d) {
    return (hidden & 7) == 0 && aligned16(a) && aligned16(b) && aligned16(c) && aligned16(d);
}

// x, out: (rows, hidden) bf16; weight: (hidden,) bf16. grid = rows.
extern "C" __global__ void rms_norm_bf16(const bf16_t* x, const bf16_t* weight, bf16_t* out,
                                         int hidden, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    const long long row = (long long)blockIdx.x * hidden;
    const bf16_t* xr = x + row;
    bf16_t* outr = out + row;
    if (vec8_ok(hidden, x, weight, out, x)) {
        float r = inv_rms(row_sum_squares<8>(xr, hidden), hidden, eps);
        row_normalize<8>(xr, weight, outr, hidden, r);
    } else {
        float r = inv_rms(row_sum_squares<1>(xr, hidden), hidden, eps);
        row_normalize<1>(xr, weight, outr, hidden, r);
    }
}

// Fused residual add: sum_out = bf16(x + residual); out = rms_norm(sum_out). sum_out may alias
// residual and out may alias x: each thread re-reads only the elements it wrote itself.
extern "C" __global__ void add_rms_norm_bf16(const bf16_t* x, const bf16_t* residual,
                                             const bf16_t* weight, bf16_t* out, bf16_t* sum_out,
                                             int hidden, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    const long long row = (long long)blockIdx.x * hidden;
    if (vec8_ok(hidden, x, residual, out, sum_out) && aligned16(weight)) {
        float r = inv_rms(row_add<8>(x + row, residual + row, sum_out + row, hidden), hidden, eps);
        row_normalize<8>(sum_out + row, weight, out + row, hidden, r);
    } else {
        float r = inv_rms(row_add<1>(x + row, residual + row, sum_out + row, hidden), hidden, eps);
        row_normalize<1>(sum_out + row, weight, out + row, hidden, r);
    }
}
