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
#define GDN_WALK_MAX_DK 256

// w: (BH, n, L, dk); u: (BH, n, L, dv), U in, u out; k_tail: (BH, n, dk, L); gamma: (BH, n);
// state: (BH, dk, dv) in / out; starts: (BH, n, dk, dv) out. Grid (ceil(dv / 16), BH).
extern "C" __global__ void __launch_bounds__(GDN_WALK_THREADS)
gdn_chunk_walk_f32(const float* __restrict__ w, float* __restrict__ u, const float* __restrict__ k_tail,
                   const float* __restrict__ gamma, float* __restrict__ state, float* __restrict__ starts,
                   int chunks, int dk, int dv) {
    __shared__ float s[GDN_WALK_MAX_DK * GDN_WALK_COLS];  // this CTA's columns of S, row-major
    __shared__ float corr[GDN_CHUNK * GDN_WALK_COLS];  // u_n's columns
    const int bh = blockIdx.y, col0 = blockIdx.x * GDN_WALK_COLS, tid = threadIdx.x;
    const int cols = min(GDN_WALK_COLS, dv - col0);
    float* state_bh = state + (long long)bh * dk * dv;
    for (int e = tid; e < dk * GDN_WALK_COLS; e += GDN_WALK_THREADS) {
        const int i = e / GDN_WALK_COLS, c = e % GDN_WALK_COLS;
        s[e] = c < cols ? state_bh[(long long)i * dv + col0 + c] : 0.0f;
    }
    __syncthreads();
    for (int n = 0; n < chunks; ++n) {
        const long long chunk = (long long)bh * chunks + n;
        float* start = starts + chunk * dk * dv;
        for (int e = tid; e < dk * GDN_WALK_COLS; e += GDN_WALK_THREADS) {
            const int i = e / GDN_WALK_COLS, c = e % GDN_WALK_COLS;
            if (c < cols) start[(long long)i * dv + col0 + c] = s[e];
        }
        // u_n = U_n - W_n S: a (L x 16) block, each thread 4 of its entries
        const float* w_n = w + chunk * GDN_CHUNK * dk;
        float* u_n = u + chunk * GDN_CHUNK * dv;
        for (int e = tid; e < GDN_CHUNK * GDN_WALK_COLS; e += GDN_WALK_THREADS) {
            const int r = e / GDN_WALK_COLS, c = e % GDN_WALK_COLS;
            float acc = 0.0f;
            for (int i = 0; i < dk; ++i) acc = fmaf(w_n[r * dk + i], s[i * GDN_WALK_COLS + c], acc);
            float value = 0.0f;
            if (c < cols) {
                value = u_n[(long long)r * dv + col0 + c] - acc;
                u_n[(long long)r * dv + col0 + c] = value;
            }
            corr[e] = value;
        }
        __syncthreads();
        // S = gamma_n S + k_tail_n u_n: a (dk x 16) block
        const float* kt_n = k_tail + chunk * dk * GDN_CHUNK;
        const float decay = gamma[chunk];
        for (int e = tid; e < dk * GDN_WALK_COLS; e += GDN_WALK_THREADS) {
            const int i = e / GDN_WALK_COLS, c = e % GDN_WALK_COLS;
            float acc = 0.0f;
            for (int j = 0; j < GDN_CHUNK; ++j) acc = fmaf(kt_n[i * GDN_CHUNK + j], corr[j * GDN_WALK_COLS + c], acc);
            s[e] = fmaf(decay, s[e], acc);
        }
        __syncthreads();
    }
    for (int e = tid; e < dk * GDN_WALK_COLS; e += GDN_WALK_THREADS) {
        const int i = e / GDN_WALK_COLS, c = e % GDN_WALK_COLS;
        if (c < cols) state_bh[(long long)i * dv + col0 + c] = s[e];
    }
}
