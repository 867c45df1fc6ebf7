// Decode GEMVs of one activation row (batch-1 decode): y = W·x, W (n, k) bf16 row-major, each
// fused with the launch that would otherwise sit next to it on the decode path:
//   gemv_norm_bf16         x = RMSNorm(x [+ residual]) in the prologue (q/k/v)
//   gemv_norm_logits_bf16  the same, its bf16 outputs stored as fp32 (the LM head's logits)
//   gemv_norm_swiglu_bf16  the same prologue; rows i and inter+i of [gate; up] give silu(g)·u
//   gemv_add_bf16          out = residual + y, the residual add of o_proj and down_proj
//   gemv_gate_add_bf16     the same, x times sigmoid(gate) first (a gated attention's o_proj)
// Batch-1 decode reads every weight once per token, so these kernels are written for bandwidth:
// each warp streams whole rows with 16-byte loads (8 per lane in flight, the next batch loaded
// while the current one is summed), and a CTA issues its first weight loads before its prologue
// so the norm's reduction hides under them, and, launched programmatically (pdl.cuh), under the
// tail of the kernel before. The grid is two CTAs per SM looping over rows.
//
// Rounding follows the unfused kernels exactly where it is defined by them: the prologue is
// add_rms_norm_bf16's (same threads per element, same sums), and every product of a bf16 tensor
// op is rounded to bf16 where torch would store it. Only the dot products' fp32 summation order
// differs from cuBLAS's.
#include "gemv.cuh"
#include "pdl.cuh"
#include "timeline.cuh"

enum Epilogue { STORE, ADD, SWIGLU };

// R rows per warp task (row t, or rows t and inter + t for SWIGLU), U chunks of each per lane
// per batch; a task's batches walk the row in 512-byte warp-wide steps.
// Out: bf16_t, or float for STORE (each output the bf16 value, widened).
// GATED: x is staged times sigmoid(gate) (GatedRow; no norm).
template <bool NORM, Epilogue EPI, int R, int U, class Out, bool GATED = false>
__device__ void gemv(const bf16_t* w, const bf16_t* x, const bf16_t* residual, const bf16_t* gamma,
                     bf16_t* sum_out, Out* out, int tasks, int k, float eps, const bf16_t* gate = nullptr) {
    __shared__ Chunk xs[GEMV_MAX_K / 8];
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * GEMV_WARPS;
    const int chunks = k / 8, batches = (chunks + 32 * U - 1) / (32 * U);
    auto row = [&](int t, int r) -> long long { return EPI == SWIGLU ? t + (long long)r * tasks : (long long)t * R + r; };
    auto load = [&](Chunk (&c)[R][U], int t, int b) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const bf16_t* p = w + row(t, r) * k;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int ci = lane + 32 * (b * U + u);
                if (ci < chunks) c[r][u] = load_weights(p + ci * 8);
            }
        }
    };

    TL_BEGIN((int)EPI + (sizeof(Out) == 4 ? 3 : 0));
    int t = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5), b = 0;
    Chunk cur[R][U];
    if (t < tasks) load(cur, t, 0);  // weights (and the norm's) only: before the wait
    const EarlyGamma early = early_gamma<NORM>(gamma, k);
    pdl_wait();
    pdl_launch_dependents();
    TL_MARK(1);
    // ADD: lane 0 loads its task's residual element when the task starts, not after its sum, so
    // the trip to L2 runs under the staging and the stream instead of between the sum and the store
    // (out may alias residual: each element is read and then written by one lane).
    bf16_t res = 0;
    if constexpr (EPI == ADD)
        if (lane == 0 && t < tasks) res = residual[t];
    if constexpr (GATED)
        stage_row<false>(xs, GatedRow{x, gate}, nullptr, nullptr, nullptr, k, eps);
    else
        stage_x<NORM>(xs, x, residual, gamma, sum_out, k, eps, &early);
    TL_MARK(2);
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    while (t < tasks) {
        int nt = t, nb = b + 1;
        if (nb == batches) nb = 0, nt += warps;
        Chunk nxt[R][U];
        if (nt < tasks) load(nxt, nt, nb);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int ci = lane + 32 * (b * U + u);
            if (ci < chunks) {
                const Chunk xv = xs[ci];
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] = dot8(cur[r][u], xv, acc[r]);
            }
        }
        if (b == batches - 1) {
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
            if (lane == 0) {
                if constexpr (EPI == STORE && sizeof(Out) == 4) {
                    out[t] = round_bf16(acc[0]);
                } else if constexpr (EPI == STORE) {
                    out[t] = f32_to_bf16(acc[0]);
                } else if constexpr (EPI == ADD) {
                    out[t] = f32_to_bf16(bf16_to_f32(res) + round_bf16(acc[0]));
                    if (nt < tasks) res = residual[nt];
                } else {
                    const float g = round_bf16(acc[0]), u = round_bf16(acc[1]);
                    out[t] = f32_to_bf16(round_bf16(g / (1.0f + expf(-g))) * u);
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int u = 0; u < U; ++u) cur[r][u] = nxt[r][u];
        t = nt, b = nb;
    }
    TL_MARK(5);
}

// out (n,) = W (n, k) · RMSNorm(x [+ residual]) with weight gamma; sum_out (k,) receives
// bf16(x + residual) when residual is given (it may be null otherwise). k % 8 == 0, k <= GEMV_MAX_K,
// every pointer 16-byte aligned. grid: any (two CTAs per SM), block GEMV_THREADS.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2)
    gemv_norm_bf16(const bf16_t* w, const bf16_t* x, const bf16_t* residual, const bf16_t* gamma,
                   bf16_t* sum_out, bf16_t* out, int n, int k, float eps) {
    gemv<true, STORE, 1, 8>(w, x, residual, gamma, sum_out, out, n, k, eps);
}

// gemv_norm_bf16 with out (n,) fp32: each logit the bf16 value gemv_norm_bf16 stores, widened, as
// torch's .float() of the LM head's bf16 output (no copy launched after it).
extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2)
    gemv_norm_logits_bf16(const bf16_t* w, const bf16_t* x, const bf16_t* residual, const bf16_t* gamma,
                          bf16_t* sum_out, float* out, int n, int k, float eps) {
    gemv<true, STORE, 1, 8>(w, x, residual, gamma, sum_out, out, n, k, eps);
}

// out (inter,) = bf16(bf16(silu(g)) * u), g and u the bf16 rows i and inter + i of
// W (2*inter, k) · RMSNorm(x [+ residual]): the gate/up projection and silu_and_mul_bf16 in one.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2)
    gemv_norm_swiglu_bf16(const bf16_t* w, const bf16_t* x, const bf16_t* residual, const bf16_t* gamma,
                          bf16_t* sum_out, bf16_t* out, int inter, int k, float eps) {
    gemv<true, SWIGLU, 2, 4>(w, x, residual, gamma, sum_out, out, inter, k, eps);
}

// out (n,) = bf16(residual + bf16(W (n, k) · x)); out may alias residual (each element is read
// and written by one thread).
extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2)
    gemv_add_bf16(const bf16_t* w, const bf16_t* x, const bf16_t* residual, bf16_t* out, int n, int k) {
    gemv<false, ADD, 1, 8>(w, x, residual, nullptr, nullptr, out, n, k, 0.0f);
}

// gemv_add_bf16 of bf16(x * bf16(sigmoid(gate))): gate (k,) the gate half of a gated attention's
// q projection, x its attention output, as HF's attn_output * torch.sigmoid(gate) before o_proj.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2)
    gemv_gate_add_bf16(const bf16_t* w, const bf16_t* x, const bf16_t* gate, const bf16_t* residual, bf16_t* out,
                       int n, int k) {
    gemv<false, ADD, 1, 8, bf16_t, true>(w, x, residual, nullptr, nullptr, out, n, k, 0.0f, gate);
}
