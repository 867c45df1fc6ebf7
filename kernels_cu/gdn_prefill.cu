// The walk over a prefill's chunks of the gated delta rule (Ops.gdn_prefill on the cuda backend).
//
// metrale_cli/kernels/gdn_chunked.py computes every chunk's own part of the chunked (WY) form as
// batched GEMMs: W = T (beta k exp(c)), U = T (beta v), k_tail = (k exp(c_last - c))^T and
// gamma = exp(c_last) per chunk. What is left depends on the chunk before: starting from the
// state S (Dk x Dv), chunk by chunk,
//     starts[n] = S;   u_n = U_n - W_n S;   S = gamma_n S + k_tail_n u_n.
// The batched GEMMs then give the outputs from starts and u. In torch that walk is three launches a
// chunk (the host's launch rate bounds it); here it is one launch for the whole prefill.
//
// One CTA per (sequence x value head, 16 state columns): its Dk x 16 slice of S stays in shared
// memory for the whole walk; the columns of S are independent of each other. Sums run in fp32, in
// index order (not torch's order: the two agree to fp32 rounding, not bit for bit).
#ifndef METRALE_HOST_EMULATION
#include <cuda_runtime.h>
#endif

#define GDN_WALK_THREADS 256
#define GDN_WALK_COLS 16
#define GDN_CHUNK 64
#define GDN_WALK_MAX_DK 128  // a chunk's W (L x Dk) or k_tail (Dk x L) staged in shared memory: 34 KB
#define GDN_WALK_PAD 4  // floats after each staged row: the 8 rows a warp reads at once fall in 8 banks

// w: (BH, n, L, dk); u: (BH, n, L, dv), U in, u out; k_tail: (BH, n, dk, L); gamma: (BH, n);
// state: (BH, dk, dv) in / out; starts: (BH, n, dk, dv) out. Grid (ceil(dv / 16), BH); dk a
// multiple of 4 up to GDN_WALK_MAX_DK.
//
// Per chunk: W_n is staged in shared memory (coalesced 16-byte loads), each thread computes one
// row of 4 columns of u_n (a float4 of S's slice and one W value a step); then k_tail_n is staged in
// the same buffer and each thread updates two rows of 4 columns of S. Staged rows are padded by
// GDN_WALK_PAD floats: a warp reads 8 rows at a time, which unpadded (a multiple of 32 floats
// apart) would all hit one bank.
extern "C" __global__ void __launch_bounds__(GDN_WALK_THREADS)
gdn_chunk_walk_f32(const float* __restrict__ w, float* __restrict__ u, const float* __restrict__ k_tail,
                   const float* __restrict__ gamma, float* __restrict__ state, float* __restrict__ starts,
                   int chunks, int dk, int dv) {
    __shared__ __align__(16) float stage[GDN_WALK_MAX_DK * (GDN_CHUNK + GDN_WALK_PAD)];  // W_n, then k_tail_n
    __shared__ __align__(16) float s[GDN_WALK_MAX_DK * GDN_WALK_COLS];  // this CTA's columns of S, row-major
    __shared__ __align__(16) float corr[GDN_CHUNK * GDN_WALK_COLS];  // u_n's columns
    const int bh = blockIdx.y, col0 = blockIdx.x * GDN_WALK_COLS, tid = threadIdx.x;
    const int cols = min(GDN_WALK_COLS, dv - col0);
    float* state_bh = state + (long long)bh * dk * dv;
    for (int e = tid; e < dk * GDN_WALK_COLS; e += GDN_WALK_THREADS) {
        const int i = e / GDN_WALK_COLS, c = e % GDN_WALK_COLS;
        s[e] = c < cols ? state_bh[(long long)i * dv + col0 + c] : 0.0f;
    }
    const int quads = dk * GDN_CHUNK / 4;
    const int w_pitch = dk + GDN_WALK_PAD, kt_pitch = GDN_CHUNK + GDN_WALK_PAD;  // staged rows, floats
    // phase 1: thread -> row r of u_n, columns c4 .. c4+3; phase 2: rows i, i + dk/2 of S
    const int r = tid / 4, c4 = (tid % 4) * 4;
    for (int n = 0; n < chunks; ++n) {
        const long long chunk = (long long)bh * chunks + n;
        const float4* w_n = reinterpret_cast<const float4*>(w + chunk * GDN_CHUNK * dk);
        for (int e = tid; e < quads; e += GDN_WALK_THREADS) {
            const int row = e / (dk / 4), quad = e % (dk / 4);
            reinterpret_cast<float4*>(stage + row * w_pitch)[quad] = w_n[e];
        }
        __syncthreads();  // W_n staged; S (and corr) as the last chunk left them
        float* start = starts + chunk * dk * dv;
        for (int e = tid; e < dk * GDN_WALK_COLS; e += GDN_WALK_THREADS) {
            const int i = e / GDN_WALK_COLS, c = e % GDN_WALK_COLS;
            if (c < cols) start[(long long)i * dv + col0 + c] = s[e];
        }
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int i = 0; i < dk; ++i) {
            const float x = stage[r * w_pitch + i];
            const float4 y = reinterpret_cast<const float4*>(s)[(i * GDN_WALK_COLS + c4) / 4];
            acc.x = fmaf(x, y.x, acc.x), acc.y = fmaf(x, y.y, acc.y), acc.z = fmaf(x, y.z, acc.z), acc.w = fmaf(x, y.w, acc.w);
        }
        float* u_row = u + (chunk * GDN_CHUNK + r) * dv + col0;
        const float got[4] = {acc.x, acc.y, acc.z, acc.w};
        for (int c = 0; c < 4; ++c) {
            float value = 0.0f;
            if (c4 + c < cols) {
                value = u_row[c4 + c] - got[c];
                u_row[c4 + c] = value;
            }
            corr[r * GDN_WALK_COLS + c4 + c] = value;
        }
        __syncthreads();  // u_n complete; W_n no longer read
        const float4* kt_n = reinterpret_cast<const float4*>(k_tail + chunk * dk * GDN_CHUNK);
        for (int e = tid; e < quads; e += GDN_WALK_THREADS) {
            const int row = e / (GDN_CHUNK / 4), quad = e % (GDN_CHUNK / 4);
            reinterpret_cast<float4*>(stage + row * kt_pitch)[quad] = kt_n[e];
        }
        __syncthreads();
        const float decay = gamma[chunk];
        for (int i = tid / 4; i < dk; i += GDN_WALK_THREADS / 4) {
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int j = 0; j < GDN_CHUNK; ++j) {
                const float x = stage[i * kt_pitch + j];
                const float4 y = reinterpret_cast<const float4*>(corr)[(j * GDN_WALK_COLS + c4) / 4];
                sum.x = fmaf(x, y.x, sum.x), sum.y = fmaf(x, y.y, sum.y), sum.z = fmaf(x, y.z, sum.z), sum.w = fmaf(x, y.w, sum.w);
            }
            float4* row = reinterpret_cast<float4*>(s) + (i * GDN_WALK_COLS + c4) / 4;
            const float4 old = *row;
            *row = make_float4(fmaf(decay, old.x, sum.x), fmaf(decay, old.y, sum.y), fmaf(decay, old.z, sum.z),
                               fmaf(decay, old.w, sum.w));
        }
        __syncthreads();  // S updated; k_tail_n no longer read
    }
    for (int e = tid; e < dk * GDN_WALK_COLS; e += GDN_WALK_THREADS) {
        const int i = e / GDN_WALK_COLS, c = e % GDN_WALK_COLS;
        if (c < cols) state_bh[(long long)i * dv + col0 + c] = s[e];
    }
}

// The chunked rule's inputs for one sequence's T tokens, in the walk's layout, in one pass
// (gdn_chunked's torch preparation does it in about a dozen): from the conv's output (T, C) =
// [q (Hk*Dk); k (Hk*Dk); v (Hv*Dv)] (bf16, after SiLU) and the gates b, a (T, Hv), per value head h
// (key head h / (Hv / Hk)) and token t of the padded length n*L:
//   q[h, t] = l2norm(q_kh) * Dk^-0.5, k[h, t] = l2norm(k_kh) (x * rsqrt(sum x^2 + 1e-6), fp32),
//   v[h, t] = v_h, g[h, t] = -exp(A_log) * softplus(a + dt_bias) (threshold 20),
//   beta[h, t] = bf16(sigmoid(b)),
// zeros for t >= T (a padding token neither decays nor writes). Grid (n*L, Hv); a thread per
// element of the wider of Dk and Dv (threads = that, rounded up to warps, at most 256).
#include "numeric.cuh"
#include "reduce.cuh"
#include "rms_row.cuh"

extern "C" __global__ void __launch_bounds__(GDN_WALK_THREADS)
gdn_chunk_inputs_bf16(const bf16_t* __restrict__ conv, const bf16_t* __restrict__ b, const bf16_t* __restrict__ a,
                      const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* __restrict__ q,
                      float* __restrict__ k, float* __restrict__ v, float* __restrict__ g, float* __restrict__ beta,
                      int tokens, int conv_stride, int b_stride, int a_stride, int num_k_heads, int num_v_heads, int dk,
                      int dv) {
    const int t = blockIdx.x, h = blockIdx.y, padded = gridDim.x, tid = threadIdx.x;
    const int kh = h / (num_v_heads / num_k_heads);
    const long long row_k = ((long long)h * padded + t) * dk, row_v = ((long long)h * padded + t) * dv;
    const bool live = t < tokens;  // uniform over the CTA
    const bf16_t* in = conv + (long long)t * conv_stride;
    const float qx = live && tid < dk ? bf16_to_f32(in[kh * dk + tid]) : 0.0f;
    const float kx = live && tid < dk ? bf16_to_f32(in[(num_k_heads + kh) * dk + tid]) : 0.0f;
    const float rq = 1.0f / sqrtf(block_sum(qx * qx) + 1e-6f), rk = 1.0f / sqrtf(block_sum(kx * kx) + 1e-6f);
    if (tid < dk) {
        q[row_k + tid] = live ? (qx * rq) * (1.0f / sqrtf((float)dk)) : 0.0f;
        k[row_k + tid] = live ? kx * rk : 0.0f;
    }
    if (tid < dv) v[row_v + tid] = live ? bf16_to_f32(in[2 * num_k_heads * dk + h * dv + tid]) : 0.0f;
    if (tid == 0) {
        const long long at = (long long)h * padded + t;
        if (live) {
            const float x = bf16_to_f32(a[(long long)t * a_stride + h]) + dt_bias[h];
            g[at] = -expf(a_log[h]) * (x > 20.0f ? x : log1pf(expf(x)));
            beta[at] = round_bf16(1.0f / (1.0f + expf(-bf16_to_f32(b[(long long)t * b_stride + h]))));
        } else {
            g[at] = 0.0f, beta[at] = 0.0f;
        }
    }
}

// The causal depthwise conv + SiLU of one sequence's T new tokens (gdn_reference.causal_conv1d):
// out[i, c] = bf16(silu(sum over taps t < K-1 of x[p-K+1+t, c] w[c, t] + x[p, c] w[c, K-1])) at
// position p = start_pos + i, fp32, taps oldest first. Inputs before start_pos come from the
// slot's conv window (K entries of C fp32 channels, position p in entry p % K), the rest from
// mixed (T rows of C bf16 at mixed_stride). Then the window holds the last K-1 inputs: the CTAs of
// token block 0 read the window at their start and write it at their end, a thread per channel,
// so no entry is written while another thread reads it. Grid (ceil(C / 256), ceil(T /
// GDN_CONV_TOKENS)), block 256; taps <= GDN_MAX_TAPS.
#define GDN_CONV_THREADS 256
#define GDN_CONV_TOKENS 64  // tokens a thread walks, its window in registers
#define GDN_MAX_TAPS 8

__device__ __forceinline__ float gdn_silu(float x) { return x / (1.0f + expf(-x)); }

extern "C" __global__ void __launch_bounds__(GDN_CONV_THREADS)
gdn_conv_bf16(const bf16_t* __restrict__ mixed, const bf16_t* __restrict__ weight, float* __restrict__ window,
              bf16_t* __restrict__ out, int tokens, int start_pos, int mixed_stride, int channels, int taps) {
    const int c = blockIdx.x * GDN_CONV_THREADS + threadIdx.x, t0 = blockIdx.y * GDN_CONV_TOKENS;
    if (c >= channels) return;
    float w[GDN_MAX_TAPS], win[GDN_MAX_TAPS];  // win[t]: the input of position p - K + 1 + t
#pragma unroll
    for (int t = 0; t < GDN_MAX_TAPS; ++t) {
        w[t] = t < taps ? bf16_to_f32(weight[(long long)c * taps + t]) : 0.0f;
        win[t] = 0.0f;
        if (t >= taps - 1) continue;
        const int i = t0 - taps + 1 + t;  // the token index of that input (negative: before start_pos)
        if (i >= 0) win[t] = bf16_to_f32(mixed[(long long)i * mixed_stride + c]);
        else win[t] = window[(long long)(((start_pos + i) % taps + taps) % taps) * channels + c];
    }
    const int t1 = min(tokens, t0 + GDN_CONV_TOKENS);
    for (int i = t0; i < t1; ++i) {
        const float x = bf16_to_f32(mixed[(long long)i * mixed_stride + c]);
        float acc = 0.0f;
#pragma unroll
        for (int t = 0; t < GDN_MAX_TAPS; ++t)
            if (t < taps - 1) acc += win[t] * w[t];
        acc += x * w[taps - 1];
        out[(long long)i * channels + c] = f32_to_bf16(gdn_silu(acc));
#pragma unroll
        for (int t = 0; t + 1 < GDN_MAX_TAPS; ++t)
            if (t + 1 < taps - 1) win[t] = win[t + 1];
        if (taps >= 2) {
#pragma unroll
            for (int t = 0; t < GDN_MAX_TAPS; ++t)
                if (t == taps - 2) win[t] = x;
        }
    }
    if (blockIdx.y != 0) return;
    for (int i = max(0, tokens - taps + 1); i < tokens; ++i)  // the new inputs among the last K-1
        window[(long long)((start_pos + i) % taps) * channels + c] = bf16_to_f32(mixed[(long long)i * mixed_stride + c]);
}

// The gated RMSNorm after the rule (gdn_reference.gated_rms_norm, as gdn_decode_bf16's step 4):
// out[t, h*Dv + j] = bf16(bf16(w_j * bf16(x * r)) * silu(z)) with x = bf16(o[h, t, j]) and r =
// 1 / sqrt(sum over the head of x^2 / Dv + eps). o: the rule's fp32 output (Hv, padded, Dv); z: T
// rows of Hv*Dv bf16 at z_stride. Grid (T, Hv), block Dv rounded up to warps.
extern "C" __global__ void __launch_bounds__(GDN_WALK_THREADS)
gdn_gated_norm_bf16(const float* __restrict__ o, const bf16_t* __restrict__ z, const bf16_t* __restrict__ norm,
                    bf16_t* __restrict__ out, int padded, int z_stride, int num_v_heads, int dv, float eps) {
    const int t = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const bool live = j < dv;
    const float x = live ? round_bf16(o[((long long)h * padded + t) * dv + j]) : 0.0f;
    const float r = inv_rms(block_sum(x * x), dv, eps);
    if (!live) return;
    const float zf = bf16_to_f32(z[(long long)t * z_stride + h * dv + j]);
    out[((long long)t * num_v_heads + h) * dv + j] =
        f32_to_bf16(round_bf16(rms_scaled(x, bf16_to_f32(norm[j]), r)) * gdn_silu(zf));
}
