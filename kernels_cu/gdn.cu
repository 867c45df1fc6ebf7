// The Gated DeltaNet mixer of one decode token per row (Qwen3-Next / Qwen3.5 linear attention),
// between the in- and out-projections, in one launch: gdn_reference.decode's arithmetic, rounded
// where it rounds to bf16.
//
// A CTA per (value head h, row b), a thread per state column j < Dv (Dv rounded up to warps):
//   1. the causal depthwise conv + SiLU, rounded to bf16, of the channels the head reads: the Dk q
//      and Dk k channels of its key head kh = h / (Hv / Hk) (each CTA of the group computes them)
//      and its own Dv v channels, over the slot's window: the conv pool keeps the input of
//      position p in entry p % K, so the step reads entries p-K+1 .. p-1 and writes entry p. The
//      q / k inputs are written by the group's first CTA only, the v inputs by their own CTA: no
//      CTA writes an entry another one reads in the same launch;
//   2. q and k L2-normalised over Dk in fp32 (x * (1 / sqrt(sum x^2 + 1e-6))), q then divided by
//      sqrt(Dk); beta = bf16(sigmoid(b)), g = -exp(A_log) * softplus(a + dt_bias) (threshold 20);
//   3. thread j holds state column S[:, j] (Dk fp32, registers): S *= exp(g), delta = beta *
//      (v_j - S[:, j] . k), S[:, j] += k delta, o_j = S[:, j] . q, rounded to bf16; S stored back;
//   4. the gated RMSNorm over the head's Dv outputs: bf16(bf16(w * bf16(o * r)) * silu(z)).
// Columns are independent in the delta rule, so a thread needs no other thread's state; the sums
// over Dk (q, k norms) and over Dv (the gated norm) are block reductions.
#include "numeric.cuh"
#include "pdl.cuh"
#include "reduce.cuh"
#include "rms_row.cuh"

#define GDN_MAX_THREADS 256  // the largest Dv served: a thread per state column

struct GdnArgs {
    const bf16_t *mixed, *z, *b, *a;  // rows of [q; k; v] (C), Hv*Dv, Hv, Hv at the given strides
    const bf16_t* conv;               // (C, K)
    const float *a_log, *dt_bias;     // (Hv,)
    const bf16_t* norm;               // (Dv,)
    float* conv_pool;                 // (S+1, K, C)
    float* state_pool;                // (S+1, Hv, Dk, Dv)
    const int *slots, *positions;     // (B,)
    bf16_t* out;                      // (B, Hv*Dv)
    int mixed_stride, z_stride, b_stride, a_stride, num_k_heads, num_v_heads, head_v_dim, taps;
    float eps;
};

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// Conv channel c of row `in` over the slot's `window` (K entries of C channels) at position p:
// taps oldest first, the new input last; SiLU, rounded to bf16. `store`: write the new input
// into entry p % K.
__device__ __forceinline__ float conv_channel(const GdnArgs& g, const bf16_t* in, float* window, int c, int channels,
                                              int p, bool store) {
    const int taps = g.taps;
    const bf16_t* w = g.conv + (long long)c * taps;
    const float x = bf16_to_f32(in[c]);
    float acc = 0.0f;
    for (int t = 0; t < taps - 1; ++t)  // entries of positions p-K+1 .. p-1
        acc += window[(long long)((p + 1 + t) % taps) * channels + c] * bf16_to_f32(w[t]);
    acc += x * bf16_to_f32(w[taps - 1]);
    if (store) window[(long long)(p % taps) * channels + c] = x;
    return round_bf16(silu(acc));
}

// s . x over DK elements in four interleaved partial sums (fewer dependent adds).
template <int DK>
__device__ __forceinline__ float column_dot(const float* s, const float* x) {
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < DK; ++i) part[i & 3] += s[i] * x[i];
    return (part[0] + part[1]) + (part[2] + part[3]);
}

template <int DK>
__device__ void gdn_head(const GdnArgs& g) {
    __shared__ float qs[DK], ks[DK];
    const int h = blockIdx.x, row = blockIdx.y, j = threadIdx.x;
    const int hk = g.num_k_heads, hv = g.num_v_heads, dv = g.head_v_dim, group = hv / hk, kh = h / group;
    const int channels = 2 * hk * DK + hv * dv;
    const bool column = j < dv;
    // Before the wait only what no launch writes: the head's parameters.
    const float w_norm = column ? bf16_to_f32(g.norm[j]) : 0.0f;
    const float a_log = g.a_log[h], dt_bias = g.dt_bias[h];
    pdl_wait();
    pdl_launch_dependents();
    const int slot = g.slots[row], p = g.positions[row];
    float* window = g.conv_pool + (long long)slot * g.taps * channels;
    float* state = g.state_pool + ((long long)slot * hv + h) * DK * dv + j;
    float s[DK];
    if (column) {
#pragma unroll
        for (int i = 0; i < DK; ++i) s[i] = state[(long long)i * dv];
    }
    const bf16_t* in = g.mixed + (long long)row * g.mixed_stride;
    const bool writer = h % group == 0;
    float qq = 0.0f, kk = 0.0f;
    for (int i = j; i < DK; i += blockDim.x) {
        const float q = conv_channel(g, in, window, kh * DK + i, channels, p, writer);
        const float k = conv_channel(g, in, window, (hk + kh) * DK + i, channels, p, writer);
        qs[i] = q, ks[i] = k;
        qq += q * q, kk += k * k;
    }
    const float v = column ? conv_channel(g, in, window, 2 * hk * DK + h * dv + j, channels, p, true) : 0.0f;
    const float z = column ? bf16_to_f32(g.z[(long long)row * g.z_stride + h * dv + j]) : 0.0f;
    const float rq = 1.0f / sqrtf(block_sum(qq) + 1e-6f), rk = 1.0f / sqrtf(block_sum(kk) + 1e-6f);
    const float root_dk = sqrtf((float)DK);
    for (int i = j; i < DK; i += blockDim.x) qs[i] = qs[i] * rq / root_dk, ks[i] *= rk;
    const float beta = round_bf16(1.0f / (1.0f + expf(-bf16_to_f32(g.b[(long long)row * g.b_stride + h]))));
    const float x = bf16_to_f32(g.a[(long long)row * g.a_stride + h]) + dt_bias;
    const float decay = expf(-expf(a_log) * (x > 20.0f ? x : log1pf(expf(x))));
    __syncthreads();
    float delta = 0.0f, o = 0.0f;
    if (column) {
#pragma unroll
        for (int i = 0; i < DK; ++i) s[i] *= decay;
        delta = (v - column_dot<DK>(s, ks)) * beta;
    }
    // A barrier between the two passes over k: without it the compiler keeps k's Dk values in
    // registers for the second pass besides the column's Dk (at Dk 128: 255 registers and 232
    // bytes of spills; with it none spilled, about 200 registers needed).
    __syncthreads();
    if (column) {
#pragma unroll
        for (int i = 0; i < DK; ++i) s[i] += ks[i] * delta;
        o = round_bf16(column_dot<DK>(s, qs));
#pragma unroll
        for (int i = 0; i < DK; ++i) state[(long long)i * dv] = s[i];
    }
    const float r = inv_rms(block_sum(o * o), dv, g.eps);
    if (column) g.out[((long long)row * hv + h) * dv + j] = f32_to_bf16(round_bf16(rms_scaled(o, w_norm, r)) * silu(z));
}

// grid = (Hv, B), block = Dv rounded up to a multiple of 32 (Dv <= GDN_MAX_THREADS). head_k_dim:
// 16, 32, 64 or 128; Hv a multiple of Hk. mixed / z / b / a: row r at r * its stride. Pools are
// updated in place at the rows' slots (padding rows may share one scratch slot, whose contents
// are then unspecified). Launched programmatically: waits before reading anything a launch
// writes.
extern "C" __global__ void __launch_bounds__(GDN_MAX_THREADS)
    gdn_decode_bf16(const bf16_t* mixed, const bf16_t* z, const bf16_t* b, const bf16_t* a, const bf16_t* conv,
                    const float* a_log, const float* dt_bias, const bf16_t* norm, float* conv_pool, float* state_pool,
                    const int* slots, const int* positions, bf16_t* out, int mixed_stride, int z_stride, int b_stride,
                    int a_stride, int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim, int taps,
                    float eps) {
    const GdnArgs g{mixed, z, b, a, conv, a_log, dt_bias, norm, conv_pool, state_pool, slots, positions, out,
                    mixed_stride, z_stride, b_stride, a_stride, num_k_heads, num_v_heads, head_v_dim, taps, eps};
    switch (head_k_dim) {
        case 16: gdn_head<16>(g); break;
        case 32: gdn_head<32>(g); break;
        case 64: gdn_head<64>(g); break;
        case 128: gdn_head<128>(g); break;
    }
}
