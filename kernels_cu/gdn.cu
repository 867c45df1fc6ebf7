// The Gated DeltaNet mixer of one decode token per row (Qwen3-Next / Qwen3.5 linear attention),
// between the in- and out-projections, in one launch: gdn_reference.decode's arithmetic, rounded
// where it rounds to bf16.
//
// A CTA per (value head h, row b), GDN_SPLIT = 4 threads per state column j < Dv: thread t serves
// column j = t / 4, quarter t % 4 (lane = column_in_warp * 4 + quarter: a warp covers 8 columns,
// its state loads 4 runs of 8 consecutive floats); the block is 4 Dv rounded up to warps (1024 at
// GDN_MAX_DV 256; at most 64 registers a thread by __launch_bounds__):
//   1. the causal depthwise conv + SiLU, rounded to bf16, of the channels the head reads: the Dk q
//      and Dk k channels of its key head kh = h / (Hv / Hk) (each CTA of the group computes them)
//      and its own Dv v channels, over the slot's window: the conv pool keeps the input of
//      position p in entry p % K, so the step reads entries p-K+1 .. p-1 and writes entry p. The
//      q / k inputs are written by the group's first CTA only, the v inputs by their own CTA: no
//      CTA writes an entry another one reads in the same launch;
//   2. q and k L2-normalised over Dk in fp32 (x * (1 / sqrt(sum x^2 + 1e-6))), q then divided by
//      sqrt(Dk); beta = bf16(sigmoid(b)), g = -exp(A_log) * softplus(a + dt_bias) (threshold 20);
//   3. the 4 threads of column j hold S[:, j] (Dk/4 fp32 each, registers: rows quarter, quarter
//      + 4, ...): S *= exp(g), delta = beta * (v_j - S[:, j] . k), S[:, j] += k delta, o_j =
//      S[:, j] . q, rounded to bf16; S stored back. A dot is each thread's partial sum in row
//      order, combined (p0 + p1) + (p2 + p3) by xor shuffles: one thread's four interleaved
//      partial sums over the column, the same bits in all four threads;
//   4. the gated RMSNorm over the head's Dv outputs: bf16(bf16(w * bf16(o * r)) * silu(z)).
// Columns are independent in the delta rule, so a column's threads need no other column's state;
// the sums over Dk (q, k norms) and over Dv (the gated norm) are block reductions. The q / k conv
// channels are a thread each (2 Dk threads); each thread of a column computes its v (the column's
// first, the lead, stores the input and writes the output).
// Measured on an H200 (Qwen3.5-27B: Hk 16, Hv 48, Dk = Dv = 128, CUDA graph, back to back): one row
// 7.7 us a launch (7.9 with a thread per column), 16 rows 37.2 (37.2): the launch is a chain of
// dependent latencies (slots -> window -> conv -> norms -> state -> dots -> norm), not the state
// traffic. Loading the state before the conv was slower here (9.3 us: 36 bytes of spills at Dk 128).
// Batch 1 has an entry of its own (gdn_decode_one_bf16, gdn_head's ONE): a block of up to 512
// threads, so 92 registers, which holds the pool reads in registers from before the PDL wait (the
// 80B hybrid preset 6% faster on an H200, docs/performance.md).
#include "numeric.cuh"
#include "pdl.cuh"
#include "reduce.cuh"
#include "rms_row.cuh"
#include "timeline.cuh"

#define GDN_SPLIT 4            // threads per state column
#define GDN_MAX_DV 256         // the largest Dv served
#define GDN_MAX_THREADS 1024   // GDN_SPLIT * GDN_MAX_DV: the block of the largest Dv
#ifndef GDN_EARLY
#define GDN_EARLY 1  // pull the head's state and window into L2 before the PDL wait (0: not, for A/B)
#endif
// The most rows for which the launch pulls them: on an H200 the pull gained 0.7-0.8% at batch 1
// (the 80B and 27B hybrid presets) and cost 0.5% at batch 16 (Qwen3.5-27B: 48 heads x 16 rows of
// 64 KB states stream past the in-projection's weights), docs/performance.md.
#define GDN_EARLY_ROWS 1
#define GDN_PREFETCH_BYTES 4096  // a lane's state piece of that pull
#define GDN_ONE_THREADS 512   // gdn_decode_one_bf16's largest block (Dv <= 128): up to 128 registers a thread
#define GDN_ONE_MAX_TAPS 4    // its conv's most taps (the window entries it holds in registers)

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

// x, hidden from the compiler's common subexpressions (no instruction on the GPU).
__device__ __forceinline__ long long opaque(long long x) {
#if !defined(METRALE_HOST_EMULATION) && defined(__CUDA_ARCH__)
    asm volatile("" : "+l"(x));
#endif
    return x;
}

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
#pragma unroll 4
    for (int t = 0; t < taps - 1; ++t)  // entries of positions p-K+1 .. p-1
        acc += window[(long long)((p + 1 + t) % taps) * channels + c] * bf16_to_f32(w[t]);
    acc += x * bf16_to_f32(w[taps - 1]);
    if (store) window[(long long)(p % taps) * channels + c] = x;
    return round_bf16(silu(acc));
}

// A column's dot s . x over Dk, its rows split over the column's GDN_SPLIT threads: thread
// `quarter` holds rows quarter, quarter + 4, ... (s[r] is row 4r + quarter) and sums its products
// in row order; the four partial sums are combined as (p0 + p1) + (p2 + p3) by two xor shuffles
// (fp addition commutes exactly, so all four threads get the same bits): the summation order of
// one thread's four interleaved partial sums over the whole column. Every lane of the warp calls it.
template <int DK>
__device__ __forceinline__ float column_dot(const float* s, const float* x, int quarter) {
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < DK / GDN_SPLIT; ++r) part += s[r] * x[r * GDN_SPLIT + quarter];
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    return part + __shfl_xor_sync(0xffffffffu, part, 2);
}

// Before the PDL wait (up to GDN_EARLY_ROWS rows), the first warp pulls what the head reads from
// the pools into L2: its state (Dk * Dv fp32, in GDN_PREFETCH_BYTES pieces, a lane each) and the
// K-1 window entries of its q, k and v channels. The slot and position are a decode step's inputs,
// two or more launches old (pdl.cuh), read through L2 for these addresses only: the body reads
// them again after the wait, so a prefetch can cost time but never change a value. Only where Dv
// is a multiple of 4: then every piece is 16-byte aligned (channels, Dk and Dv multiples of 4), as
// the pull needs.
template <int DK>
__device__ __forceinline__ void prefetch_head(const GdnArgs& g, int h, int row, int kh, int channels) {
    const int lane = threadIdx.x & 31, hv = g.num_v_heads, dv = g.head_v_dim, taps = g.taps;
    const int slot = __ldcg(g.slots + row), p = __ldcg(g.positions + row);
    const char* state = reinterpret_cast<const char*>(g.state_pool + ((long long)slot * hv + h) * DK * dv);
    const int bytes = DK * dv * 4;
    for (int at = lane * GDN_PREFETCH_BYTES; at < bytes; at += 32 * GDN_PREFETCH_BYTES)
        pdl_prefetch_l2(state + at, min(GDN_PREFETCH_BYTES, bytes - at));
    // lane t < K - 1: entry (p + 1 + t) % K, its q, k and v channel runs
    if (lane < taps - 1) {
        const float* entry = g.conv_pool + ((long long)slot * taps + (p + 1 + lane) % taps) * channels;
        pdl_prefetch_l2(entry + kh * DK, DK * 4);
        pdl_prefetch_l2(entry + (g.num_k_heads + kh) * DK, DK * 4);
        pdl_prefetch_l2(entry + 2 * g.num_k_heads * DK + h * dv, dv * 4);
    }
}

// ONE: batch 1's entry (gdn_decode_one_bf16; a row, a thread per q / k channel, GDN_ONE_MAX_TAPS
// taps at most). Everything of the head that the last two launches do not write is loaded before
// the PDL wait, into registers: the slot and position (a decode step's inputs), its channels'
// conv weights and window entries, its state columns (pdl.cuh: what launches two or more back
// wrote, through L2). After the wait only the in-projection's row is read. The arithmetic is the
// other entry's, in the same order.
template <int DK, bool ONE>
__device__ void gdn_head(const GdnArgs& g) {
    constexpr int ROWS = DK / GDN_SPLIT;  // state rows per thread
    __shared__ float qs[DK], ks[DK];
    TL_BEGIN(ONE ? 1 : 0);  // marks: 2 q / k normalised, 3 the state updated, 4 the gated norm's sum
    const int h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const int j = tid / GDN_SPLIT, quarter = tid % GDN_SPLIT;  // lane = column_in_warp * 4 + quarter
    const int hk = g.num_k_heads, hv = g.num_v_heads, dv = g.head_v_dim, group = hv / hk, kh = h / group;
    const int channels = 2 * hk * DK + hv * dv;
    const bool column = j < dv, lead = column && quarter == 0;  // lead: the column's conv store and output
    // Before the wait: the head's parameters, which no launch writes; then the pools (below).
    const float w_norm = lead ? bf16_to_f32(g.norm[j]) : 0.0f;
    const float a_log = g.a_log[h], dt_bias = g.dt_bias[h];
    float qq = 0.0f, kk = 0.0f, v, z, b_in, a_in;
    float s[ROWS];
    float* state;
    if constexpr (ONE) {
        constexpr int T = GDN_ONE_MAX_TAPS - 1;
        const int taps = g.taps, slot = __ldcg(g.slots), p = __ldcg(g.positions);
        float* window = g.conv_pool + (long long)slot * taps * channels;
        state = g.state_pool + ((long long)slot * hv + h) * DK * dv + (long long)quarter * dv + j;
        const bool qk = tid < 2 * DK, is_k = tid >= DK;
        const int cq = ((is_k ? hk : 0) + kh) * DK + (is_k ? tid - DK : tid);  // this thread's q or k channel
        const int cv = 2 * hk * DK + h * dv + j;                                // its column's v channel
        float xq[T], xv[T], wq[T], wv[T];  // entries of positions p-K+1 .. p-1 and their taps
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const bool tap = t < taps - 1;
            const float* e = window + (long long)((p + 1 + t) % taps) * channels;
            xq[t] = qk && tap ? __ldcg(e + cq) : 0.0f;
            xv[t] = column && tap ? __ldcg(e + cv) : 0.0f;
            wq[t] = qk && tap ? bf16_to_f32(g.conv[(long long)cq * taps + t]) : 0.0f;
            wv[t] = column && tap ? bf16_to_f32(g.conv[(long long)cv * taps + t]) : 0.0f;
        }
        const float wq_new = qk ? bf16_to_f32(g.conv[(long long)cq * taps + taps - 1]) : 0.0f;
        const float wv_new = column ? bf16_to_f32(g.conv[(long long)cv * taps + taps - 1]) : 0.0f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) s[r] = column ? __ldcg(state + (long long)r * GDN_SPLIT * dv) : 0.0f;
        pdl_wait();
        pdl_launch_dependents();
        TL_MARK(1);
        // The in-projection's outputs, loaded together (load_in_order; a thread that uses one not
        // reads element 0): one trip to L2, where plain loads under their conditions were three trips
        // in a row (each converted inside its branch before the next load issued).
        const bf16_t mq = load_in_order(g.mixed + (qk ? cq : 0)), mv = load_in_order(g.mixed + (column ? cv : 0));
        const bf16_t mz = load_in_order(g.z + (lead ? h * dv + j : 0));
        const bf16_t mb = load_in_order(g.b + h), ma = load_in_order(g.a + h);
        const float iq = qk ? bf16_to_f32(mq) : 0.0f, iv = column ? bf16_to_f32(mv) : 0.0f;
        z = lead ? bf16_to_f32(mz) : 0.0f;
        b_in = bf16_to_f32(mb);
        a_in = bf16_to_f32(ma);
        // conv_channel's sums: the taps oldest first, the new input last
        float aq = 0.0f, av = 0.0f;
#pragma unroll
        for (int t = 0; t < T; ++t) {
            if (t < taps - 1) {
                aq += xq[t] * wq[t];
                av += xv[t] * wv[t];
            }
        }
        aq += iq * wq_new;
        av += iv * wv_new;
        const int entry = p % taps;
        const bool writer = h % group == 0;
        if (qk) {
            const float x = round_bf16(silu(aq));
            (is_k ? ks : qs)[is_k ? tid - DK : tid] = x;
            (is_k ? kk : qq) += x * x;
            if (writer) window[(long long)entry * channels + cq] = iq;
        }
        v = column ? round_bf16(silu(av)) : 0.0f;
        if (lead) window[(long long)entry * channels + cv] = iv;
    } else {
        if (GDN_EARLY && (int)gridDim.y <= GDN_EARLY_ROWS && tid < 32 && dv % 4 == 0)
            prefetch_head<DK>(g, h, row, kh, channels);
        pdl_wait();
        pdl_launch_dependents();
        TL_MARK(1);
        const int slot = g.slots[row], p = g.positions[row];
        float* window = g.conv_pool + (long long)slot * g.taps * channels;
        state = g.state_pool + ((long long)slot * hv + h) * DK * dv + (long long)quarter * dv + j;
        const bf16_t* in = g.mixed + (long long)row * g.mixed_stride;
        const bool writer = h % group == 0;
        for (int i = tid; i < 2 * DK; i += blockDim.x) {  // q's channels, then k's: a thread each
            const bool is_k = i >= DK;
            const int c = is_k ? i - DK : i;
            const float x = conv_channel(g, in, window, ((is_k ? hk : 0) + kh) * DK + c, channels, p, writer);
            (is_k ? ks : qs)[c] = x;
            (is_k ? kk : qq) += x * x;
        }
        // Each of the column's threads computes v (the same bits); only the lead stores the input (the
        // entry p % K it writes is none of the K-1 entries the others read).
        v = column ? conv_channel(g, in, window, 2 * hk * DK + h * dv + j, channels, p, lead) : 0.0f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) s[r] = column ? state[(long long)r * GDN_SPLIT * dv] : 0.0f;
        z = lead ? bf16_to_f32(g.z[(long long)row * g.z_stride + h * dv + j]) : 0.0f;
    }
    const float rq = 1.0f / sqrtf(block_sum(qq) + 1e-6f), rk = 1.0f / sqrtf(block_sum(kk) + 1e-6f);
    TL_MARK(2);
    const float root_dk = sqrtf((float)DK);
    for (int i = tid; i < DK; i += blockDim.x) qs[i] = qs[i] * rq / root_dk, ks[i] *= rk;
    if constexpr (!ONE) {
        b_in = bf16_to_f32(g.b[(long long)row * g.b_stride + h]);
        a_in = bf16_to_f32(g.a[(long long)row * g.a_stride + h]);
    }
    const float beta = round_bf16(1.0f / (1.0f + expf(-b_in)));
    const float x = a_in + dt_bias;
    const float decay = expf(-expf(a_log) * (x > 20.0f ? x : log1pf(expf(x))));
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) s[r] *= decay;
    const float delta = (v - column_dot<DK>(s, ks, quarter)) * beta;
    // A barrier between the two passes over k: without it the compiler keeps the thread's Dk/4
    // k values in registers for the second pass besides its Dk/4 state rows (at Dk 128 and 64
    // registers: 144 bytes of spills; with it none).
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) s[r] += ks[r * GDN_SPLIT + quarter] * delta;
    const float o = round_bf16(column_dot<DK>(s, qs, quarter));
    TL_MARK(3);
    if (column) {
        // The stores' addresses from an opaque copy of the row stride, so that the compiler need
        // not keep the loads' Dk/4 64-bit addresses live (no measured effect on the registers).
        const long long stride = opaque((long long)GDN_SPLIT * dv);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) state[r * stride] = s[r];
    }
    const float r = inv_rms(block_sum(lead ? o * o : 0.0f), dv, g.eps);
    TL_MARK(4);
    if (lead) g.out[((long long)row * hv + h) * dv + j] = f32_to_bf16(round_bf16(rms_scaled(o, w_norm, r)) * silu(z));
    TL_MARK(5);
}

// grid = (Hv, B), block = GDN_SPLIT * Dv rounded up to a multiple of 32 (Dv <= GDN_MAX_DV). head_k_dim:
// 16, 32, 64 or 128; Hv a multiple of Hk. mixed / z / b / a: row r at r * its stride. Pools are
// updated in place at the rows' slots (padding rows may share one scratch slot, whose contents
// are then unspecified). Launched programmatically: waits before reading anything a launch
// writes.
// gdn_decode_one_bf16: the same for one row (grid = (Hv, 1)) whose block has a thread per q / k
// channel (2 head_k_dim <= block <= GDN_ONE_THREADS) and a conv of up to GDN_ONE_MAX_TAPS taps:
// the same outputs and pools, its pool reads before the PDL wait (gdn_head's ONE).
#define METRALE_GDN_ENTRY(name, threads, one)                                                                     \
    extern "C" __global__ void __launch_bounds__(threads)                                                        \
        name(const bf16_t* mixed, const bf16_t* z, const bf16_t* b, const bf16_t* a, const bf16_t* conv,          \
             const float* a_log, const float* dt_bias, const bf16_t* norm, float* conv_pool, float* state_pool,   \
             const int* slots, const int* positions, bf16_t* out, int mixed_stride, int z_stride, int b_stride,   \
             int a_stride, int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim, int taps, float eps) { \
        const GdnArgs g{mixed,      z,        b,        a,           conv,        a_log,       dt_bias, norm,    \
                        conv_pool,  state_pool, slots,  positions,   out,         mixed_stride, z_stride,       \
                        b_stride,   a_stride, num_k_heads, num_v_heads, head_v_dim, taps,       eps};           \
        switch (head_k_dim) {                                                                                    \
            case 16: gdn_head<16, one>(g); break;                                                                \
            case 32: gdn_head<32, one>(g); break;                                                                \
            case 64: gdn_head<64, one>(g); break;                                                                \
            case 128: gdn_head<128, one>(g); break;                                                              \
        }                                                                                                        \
    }
METRALE_GDN_ENTRY(gdn_decode_bf16, GDN_MAX_THREADS, false)
METRALE_GDN_ENTRY(gdn_decode_one_bf16, GDN_ONE_THREADS, true)
#undef METRALE_GDN_ENTRY
