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
// memory for the whole walk; the columns of S are independent of each other. Sums run in fp32, the
// even and the odd terms apart, then added (not torch's order: the two agree to fp32 rounding, not
// bit for bit).
#ifndef METRALE_HOST_EMULATION
#include <cuda_runtime.h>
#endif
#include "pdl.cuh"

#define GDN_WALK_THREADS 256
#define GDN_WALK_COLS 16
#define GDN_CHUNK 64
#define GDN_WALK_MAX_DK 128  // a chunk's W (L x Dk) or k_tail (Dk x L) staged in shared memory: 34 KB
#define GDN_WALK_PAD 4  // floats after each staged row: the 8 rows a warp reads at once fall in 8 banks

// sum over m < len of a[m] * b[m][c4 .. c4 + 3] (b: rows of GDN_WALK_COLS floats in shared memory),
// the even and the odd terms in two sums, then added; len even.
__device__ __forceinline__ float4 gdn_walk_row_dot(const float* a, const float* b, int len, int c4) {
    float4 part[2] = {make_float4(0.0f, 0.0f, 0.0f, 0.0f), make_float4(0.0f, 0.0f, 0.0f, 0.0f)};
    for (int m = 0; m < len; m += 2) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float x = a[m + h];
            const float4 y = reinterpret_cast<const float4*>(b)[((m + h) * GDN_WALK_COLS + c4) / 4];
            part[h].x = fmaf(x, y.x, part[h].x), part[h].y = fmaf(x, y.y, part[h].y);
            part[h].z = fmaf(x, y.z, part[h].z), part[h].w = fmaf(x, y.w, part[h].w);
        }
    }
    return make_float4(part[0].x + part[1].x, part[0].y + part[1].y, part[0].z + part[1].z, part[0].w + part[1].w);
}

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
        if (tid == 0) {  // into L2 ahead of their staging: this chunk's k_tail, the next chunk's W
            pdl_prefetch_l2(k_tail + chunk * dk * GDN_CHUNK, dk * GDN_CHUNK * 4);
            if (n + 1 < chunks) pdl_prefetch_l2(w + (chunk + 1) * GDN_CHUNK * dk, GDN_CHUNK * dk * 4);
        }
        float* u_row = u + (chunk * GDN_CHUNK + r) * dv + col0;
        float u_in[4];  // this thread's U_n, loaded before the staging it does not depend on
#pragma unroll
        for (int c = 0; c < 4; ++c) u_in[c] = c4 + c < cols ? u_row[c4 + c] : 0.0f;
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
        const float4 dot = gdn_walk_row_dot(stage + r * w_pitch, s, dk, c4);  // (W_n S)[r, c4 ..]
        const float got[4] = {dot.x, dot.y, dot.z, dot.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float value = 0.0f;
            if (c4 + c < cols) {
                value = u_in[c] - got[c];
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
            const float4 sum = gdn_walk_row_dot(stage + i * kt_pitch, corr, GDN_CHUNK, c4);  // (k_tail_n u_n)[i, c4 ..]
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

// Every chunk's own part of the chunked rule (gdn_chunked.chunks before its walk), for one chunk of
// one (sequence x value head) a CTA, in place of a dozen torch launches. With c the chunk's
// cumulative decay (c_i = g_0 + .. + g_i) and D[i, j] = exp(c_i - c_j):
//   T = (I + A)^-1, A = strictly-lower(beta_i (k_i . k_j) D[i, j])   (by blocks of 16: the
//                                                                      diagonal ones by forward
//                                                                      substitution)
//   w = T (beta k exp(c)),  u = T (beta v),  k_tail = (k exp(c_last - c))^T,  gamma = exp(c_last),
//   scores = lower(q k^T * D) (diagonal included),  q <- q exp(c)      (in place: the walk's
//                                                                      output GEMM reads it)
// q, k (BH, n*L, dk), v (BH, n*L, dv), g, beta (BH, n*L) fp32 as gdn_chunk_inputs_bf16 writes
// them; w (BH, n, L, dk), u (BH, n, L, dv), k_tail (BH, n, dk, L), gamma (BH, n), scores (BH, n,
// L, L) fp32. Sums in fp32, in index order but for the substitution's two interleaved sums (torch's
// GEMMs and solve sum in theirs: equal to fp32 rounding).
// Grid (n, BH), block GDN_PREP_THREADS, dynamic shared memory of 4 * (L (dk + 4) + L (max(dk, dv)
// + 4) + 2 L^2 + 3 L + 3 * 16^2) bytes (the layout below); dk, dv multiples of 4, dk <=
// GDN_WALK_MAX_DK, dv <= GDN_PREP_MAX_DV.
//
// The chunk's rows are staged with a pitch of width + 4 floats: eight lanes reading eight rows'
// float4 at one column (the dot products' j operand) fall in 32 distinct banks. A warp takes 8
// rows (w, w + 8, ..) and its lanes the columns, so the row operand is a broadcast.
#define GDN_PREP_THREADS 256
#define GDN_PREP_MAX_DV 256
#define GDN_PREP_WARPS (GDN_PREP_THREADS / 32)
#define GDN_PREP_ROWS (GDN_CHUNK / GDN_PREP_WARPS)  // rows of a chunk a warp takes
#define GDN_PREP_BLOCK 16  // the solve's blocks

// acc[r][h] = rows_i . kb_j for row i = warp + 8 r of `rows` and column j = lane + 32 h of kb.
__device__ __forceinline__ void gdn_prep_dots(const float* rows, int rows_pitch, const float* kb, int kb_pitch, int dk,
                                              float (&acc)[GDN_PREP_ROWS][2]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < GDN_PREP_ROWS; ++r) acc[r][0] = acc[r][1] = 0.0f;
    for (int d = 0; d < dk; d += 4) {
        const float4 b0 = *reinterpret_cast<const float4*>(kb + lane * kb_pitch + d);
        const float4 b1 = *reinterpret_cast<const float4*>(kb + (lane + 32) * kb_pitch + d);
#pragma unroll
        for (int r = 0; r < GDN_PREP_ROWS; ++r) {
            const float4 a = *reinterpret_cast<const float4*>(rows + (warp + GDN_PREP_WARPS * r) * rows_pitch + d);
            acc[r][0] = fmaf(a.x, b0.x, acc[r][0]), acc[r][0] = fmaf(a.y, b0.y, acc[r][0]);
            acc[r][0] = fmaf(a.z, b0.z, acc[r][0]), acc[r][0] = fmaf(a.w, b0.w, acc[r][0]);
            acc[r][1] = fmaf(a.x, b1.x, acc[r][1]), acc[r][1] = fmaf(a.y, b1.y, acc[r][1]);
            acc[r][1] = fmaf(a.z, b1.z, acc[r][1]), acc[r][1] = fmaf(a.w, b1.w, acc[r][1]);
        }
    }
}

// out[i][j] = scale_i (rows_i . kb_j) exp(c_i - c_j) for j < i (or j <= i with `diagonal`), 0 above;
// scale_i = scale[i], or 1 where scale is null. out: L x L, row-major (shared or global memory).
__device__ __forceinline__ void gdn_prep_decayed_dots(const float* rows, int rows_pitch, const float* kb, int kb_pitch,
                                                      int dk, const float* cs, const float* scale, bool diagonal,
                                                      float* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[GDN_PREP_ROWS][2];
    gdn_prep_dots(rows, rows_pitch, kb, kb_pitch, dk, acc);
#pragma unroll
    for (int r = 0; r < GDN_PREP_ROWS; ++r) {
        const int i = warp + GDN_PREP_WARPS * r;
        const float si = scale != nullptr ? scale[i] : 1.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = lane + 32 * h;
            out[i * GDN_CHUNK + j] = j < i || (diagonal && j == i) ? si * acc[r][h] * expf(cs[i] - cs[j]) : 0.0f;
        }
    }
}

// out (L, width) rows of this chunk = t (L x L, row-major) @ x (L rows of `width` at x_pitch),
// written at out_rows (row stride width): lane -> 4 columns, warp -> 8 rows; t is lower triangular
// (zeros above), so row i sums j <= i.
__device__ __forceinline__ void gdn_prep_lower_gemm(const float* t, const float* x, int x_pitch, int width,
                                                    float* __restrict__ out_rows) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int c = 4 * lane; c < width; c += 128) {
        float4 acc[GDN_PREP_ROWS];
#pragma unroll
        for (int r = 0; r < GDN_PREP_ROWS; ++r) acc[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int j = 0; j < GDN_CHUNK; ++j) {
            const float4 y = *reinterpret_cast<const float4*>(x + j * x_pitch + c);
#pragma unroll
            for (int r = 0; r < GDN_PREP_ROWS; ++r) {
                const float a = t[(warp + GDN_PREP_WARPS * r) * GDN_CHUNK + j];
                acc[r].x = fmaf(a, y.x, acc[r].x), acc[r].y = fmaf(a, y.y, acc[r].y);
                acc[r].z = fmaf(a, y.z, acc[r].z), acc[r].w = fmaf(a, y.w, acc[r].w);
            }
        }
#pragma unroll
        for (int r = 0; r < GDN_PREP_ROWS; ++r)
            *reinterpret_cast<float4*>(out_rows + (long long)(warp + GDN_PREP_WARPS * r) * width + c) = acc[r];
    }
}

// L rows of `width` floats from global (row stride width) into shared memory at `pitch`, by the
// threads first .. GDN_PREP_THREADS - 1.
__device__ __forceinline__ void gdn_prep_stage(const float* __restrict__ src, int width, float* dst, int pitch,
                                               int first = 0) {
    const int quads = width / 4;
    for (int e = threadIdx.x - first; e < GDN_CHUNK * quads; e += GDN_PREP_THREADS - first) {
        const int row = e / quads, quad = e % quads;
        *reinterpret_cast<float4*>(dst + row * pitch + 4 * quad) =
            reinterpret_cast<const float4*>(src + (long long)row * width)[quad];
    }
}

extern "C" __global__ void __launch_bounds__(GDN_PREP_THREADS)
gdn_chunk_prep_f32(float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                   const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ w,
                   float* __restrict__ u, float* __restrict__ k_tail, float* __restrict__ gamma,
                   float* __restrict__ scores, int chunks, int dk, int dv) {
#ifdef METRALE_HOST_EMULATION
    static float smem[GDN_CHUNK * (GDN_WALK_MAX_DK + 4) + GDN_CHUNK * (GDN_PREP_MAX_DV + 4) +
                      2 * GDN_CHUNK * GDN_CHUNK + 3 * GDN_CHUNK + 3 * GDN_PREP_BLOCK * GDN_PREP_BLOCK];
#else
    extern __shared__ __align__(16) float smem[];
#endif
    const int kp = dk + 4, xp = (dk > dv ? dk : dv) + 4;
    float* kb = smem;                              // k rows
    float* xb = kb + GDN_CHUNK * kp;               // v rows, then q rows
    float* ab = xb + GDN_CHUNK * xp;               // A, then T beta exp(c)
    float* tb = ab + GDN_CHUNK * GDN_CHUNK;        // T beta
    float* cs = tb + GDN_CHUNK * GDN_CHUNK;        // c
    float* bs = cs + GDN_CHUNK;                    // beta
    float* es = bs + GDN_CHUNK;                    // exp(c)
    float* xs = es + GDN_CHUNK;                    // the solve's sums: 3 blocks of 16 x 16
    const int tid = threadIdx.x;
    const long long chunk = (long long)blockIdx.y * chunks + blockIdx.x;  // (BH, n) index
    const long long row0 = chunk * GDN_CHUNK;                            // first token row
    gdn_prep_stage(k + row0 * dk, dk, kb, kp);
    if (tid < GDN_CHUNK) bs[tid] = beta[row0 + tid];
    if (tid == 0) {
        float c = 0.0f;
        for (int i = 0; i < GDN_CHUNK; ++i) c += g[row0 + i], cs[i] = c;
    }
    __syncthreads();
    if (tid < GDN_CHUNK) es[tid] = expf(cs[tid]);
    gdn_prep_decayed_dots(kb, kp, kb, kp, dk, cs, bs, false, ab);  // A
    __syncthreads();  // A complete
    // T = (I + A)^-1 by blocks of 16 (A is strictly lower): the four diagonal blocks by forward
    // substitution, a thread per column (T[i][c] = [i == c] - sum_{c <= j < i} A[i][j] T[j][c]),
    // while the other warps stage v; then the blocks below them, one block diagonal at a time:
    // T_ij = -T_ii sum_{j <= m < i} A_im T_mj (X = the sum, in xs).
    for (int e = tid; e < GDN_CHUNK * GDN_CHUNK; e += GDN_PREP_THREADS) tb[e] = 0.0f;
    __syncthreads();
    if (tid < GDN_CHUNK) {
        const int base = tid & ~(GDN_PREP_BLOCK - 1), c = tid;
        for (int i = base; i < base + GDN_PREP_BLOCK; ++i) {
            float s0 = 0.0f, s1 = 0.0f;
            int j = c;
            for (; j + 1 < i; j += 2) {
                s0 = fmaf(ab[i * GDN_CHUNK + j], tb[j * GDN_CHUNK + c], s0);
                s1 = fmaf(ab[i * GDN_CHUNK + j + 1], tb[(j + 1) * GDN_CHUNK + c], s1);
            }
            if (j < i) s0 = fmaf(ab[i * GDN_CHUNK + j], tb[j * GDN_CHUNK + c], s0);
            if (i >= c) tb[i * GDN_CHUNK + c] = i == c ? 1.0f : -(s0 + s1);
        }
    } else {
        gdn_prep_stage(v + row0 * dv, dv, xb, xp, GDN_CHUNK);  // the other warps stage v meanwhile
    }
    __syncthreads();  // the diagonal blocks of T; v staged
    for (int d = 1; d < GDN_CHUNK / GDN_PREP_BLOCK; ++d) {
        const int blocks = GDN_CHUNK / GDN_PREP_BLOCK - d;  // (i, j = i - d) for i = d ..
        for (int e = tid; e < blocks * GDN_PREP_BLOCK * GDN_PREP_BLOCK; e += GDN_PREP_THREADS) {
            const int bi = d + e / (GDN_PREP_BLOCK * GDN_PREP_BLOCK), bj = bi - d;
            const int r = bi * GDN_PREP_BLOCK + (e / GDN_PREP_BLOCK) % GDN_PREP_BLOCK;
            const int c = bj * GDN_PREP_BLOCK + e % GDN_PREP_BLOCK;
            float x = 0.0f;
            for (int m = bj * GDN_PREP_BLOCK; m < bi * GDN_PREP_BLOCK; ++m)
                x = fmaf(ab[r * GDN_CHUNK + m], tb[m * GDN_CHUNK + c], x);
            xs[e] = x;
        }
        __syncthreads();
        for (int e = tid; e < blocks * GDN_PREP_BLOCK * GDN_PREP_BLOCK; e += GDN_PREP_THREADS) {
            const int bi = d + e / (GDN_PREP_BLOCK * GDN_PREP_BLOCK), bj = bi - d;
            const int rr = (e / GDN_PREP_BLOCK) % GDN_PREP_BLOCK, cc = e % GDN_PREP_BLOCK;
            const int r = bi * GDN_PREP_BLOCK + rr;
            const float* x = xs + (e / (GDN_PREP_BLOCK * GDN_PREP_BLOCK)) * GDN_PREP_BLOCK * GDN_PREP_BLOCK;
            float t = 0.0f;
            for (int m = bi * GDN_PREP_BLOCK; m <= r; ++m)  // T_ii is lower triangular
                t = fmaf(tb[r * GDN_CHUNK + m], x[(m - bi * GDN_PREP_BLOCK) * GDN_PREP_BLOCK + cc], t);
            tb[r * GDN_CHUNK + bj * GDN_PREP_BLOCK + cc] = -t;
        }
        __syncthreads();
    }
    for (int e = tid; e < GDN_CHUNK * GDN_CHUNK; e += GDN_PREP_THREADS) {
        const int j = e % GDN_CHUNK;
        const float tbeta = tb[e] * bs[j];
        ab[e] = tbeta * es[j];
        tb[e] = tbeta;
    }
    __syncthreads();
    gdn_prep_lower_gemm(tb, xb, xp, dv, u + row0 * dv);
    gdn_prep_lower_gemm(ab, kb, kp, dk, w + row0 * dk);
    const float last = cs[GDN_CHUNK - 1];
    float* kt = k_tail + chunk * dk * GDN_CHUNK;
    for (int e = tid; e < dk * GDN_CHUNK; e += GDN_PREP_THREADS) {
        const int d = e / GDN_CHUNK, j = e % GDN_CHUNK;
        kt[e] = kb[j * kp + d] * expf(last - cs[j]);
    }
    if (tid == 0) gamma[chunk] = expf(last);
    __syncthreads();  // v no longer read
    gdn_prep_stage(q + row0 * dk, dk, xb, xp);
    __syncthreads();
    gdn_prep_decayed_dots(xb, xp, kb, kp, dk, cs, nullptr, true, scores + chunk * GDN_CHUNK * GDN_CHUNK);
    for (int e = tid; e < GDN_CHUNK * dk; e += GDN_PREP_THREADS) {
        const int i = e / dk, d = e % dk;
        q[row0 * dk + e] = xb[i * xp + d] * es[i];
    }
}
