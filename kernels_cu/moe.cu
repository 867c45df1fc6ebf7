// The routed experts of a MoE FFN for a few rows (decode, short prefill chunks), in three launches
// that read each chosen expert's weights once however many rows chose it, and keep every expert
// id on the device (graph-captured, no host sync):
//   moe_route_bf16     one CTA: each row's softmax over the router's logits, its top-k (ties to
//                      the lower expert id, as torch.topk), renormalized when asked; then the
//                      plan: the experts some row chose, ascending, and each one's (row, slot)
//                      pairs; and the count of experts read.
//   moe_gate_up_bf16   per chosen expert and 8 columns of its width: silu(gate·x) * (up·x) for
//                      every pair that chose it (the x rows staged in shared memory) -> act.
//   moe_down_bf16      per chosen expert and 32 hidden columns: w * (down·act) for each pair -> y;
//                      the last CTA of a column tile sums each row's top-k slots in slot order
//                      [+ residual] -> out.
// Every output of a pair depends on that pair's row alone, and each row's sum runs in slot order,
// so a row's result does not depend on the other rows of the batch. Rounding follows HF's bf16
// expert loop where it stores: gate, up, silu(gate), the product, down's output, its product with
// the bf16 weight; the k products are summed in fp32 and rounded once (HF adds them in bf16).
//
// The plan (int32): plan[0] = chosen experts n; plan[1 .. 1+E) their ids, ascending; plan[1+E ..
// 2+2E) offsets (n + 1 entries) into the pairs plan[2+2E ..), each the index row * top_k + slot.
#include "gemv.cuh"
#include "pdl.cuh"

#define MOE_THREADS 256  // the expert kernels' CTA: a warp per output column
#define MOE_WARPS (MOE_THREADS / 32)
#define MOE_ROUTE_THREADS 512
#define MOE_MAX_EXPERTS 1024
#define MOE_MAX_PAIRS 1024  // rows * top_k of one launch
#define MOE_STAGE_ELEMS 16384  // the staged input rows: 32 KB of bf16
#define MOE_MAX_ROWS_PER_PASS 8
#define MOE_DOWN_COLS 4  // hidden columns per warp of moe_down_bf16

// Warp arg-max: the larger value, on ties the lower index (torch.topk's order).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = (int)__shfl_xor_sync(0xffffffffu, (float)i, o);
        if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
    }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One row's routing by one warp, V = ceil(E / 32) probabilities a lane (expert lane + 32 v):
// softmax, top-k by k rounds of a warp arg-max, the weights; the chosen ids go to `chosen` and
// are counted per expert.
template <int V>
__device__ void route_row(const bf16_t* logits, int* ids, float* weights, int* chosen, unsigned* count, int r,
                          int num_experts, int top_k, int normalize) {
    const int lane = threadIdx.x & 31;
    float p[V];
    float m = METRALE_NEG_INF;
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const int e = lane + 32 * v;
        p[v] = e < num_experts ? bf16_to_f32(logits[(long long)r * num_experts + e]) : METRALE_NEG_INF;
        m = fmaxf(m, p[v]);
    }
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int v = 0; v < V; ++v) {
        p[v] = lane + 32 * v < num_experts ? expf(p[v] - m) : 0.0f;
        sum += p[v];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int v = 0; v < V; ++v) p[v] = lane + 32 * v < num_experts ? p[v] / sum : -1.0f;  // -1: no expert
    float picked = 0.0f, mine = 0.0f;
    for (int s = 0; s < top_k; ++s) {
        float best = -1.0f;
        int i = MOE_MAX_EXPERTS;
#pragma unroll
        for (int v = 0; v < V; ++v)
            if (p[v] > best) best = p[v], i = lane + 32 * v;  // ascending ids: the first of equals stays
        warp_argmax(best, i);
#pragma unroll
        for (int v = 0; v < V; ++v)
            if (lane + 32 * v == i) p[v] = -2.0f;  // taken
        if (lane == s) mine = best;
        picked += best;
        if (lane == 0) {
            chosen[r * top_k + s] = i;
            ids[r * top_k + s] = i;
            atomicAdd(&count[i], 1u);
        }
    }
    if (lane < top_k) weights[r * top_k + lane] = normalize ? mine / picked : mine;
}

// logits (rows, E) bf16 -> ids (rows, k) int32, weights (rows, k) fp32, the plan, experts_read[0]
// += n. rows * k <= MOE_MAX_PAIRS, E <= MOE_MAX_EXPERTS, k <= min(E, 32). grid 1, block: up to
// MOE_ROUTE_THREADS, a multiple of 32 (a warp per row at a time).
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS)
    moe_route_bf16(const bf16_t* logits, int* ids, float* weights, int* plan, long long* experts_read, int rows,
                   int num_experts, int top_k, int normalize) {
    __shared__ int chosen[MOE_MAX_PAIRS];
    __shared__ unsigned count[MOE_MAX_EXPERTS];
    __shared__ unsigned fill[MOE_MAX_EXPERTS];
    __shared__ int lane_active[32], lane_pairs[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int per_lane = (num_experts + 31) / 32;
    pdl_wait();
    pdl_launch_dependents();
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int r = warp; r < rows; r += warps) {
        if (per_lane <= 4) route_row<4>(logits, ids, weights, chosen, count, r, num_experts, top_k, normalize);
        else if (per_lane <= 8) route_row<8>(logits, ids, weights, chosen, count, r, num_experts, top_k, normalize);
        else if (per_lane <= 16) route_row<16>(logits, ids, weights, chosen, count, r, num_experts, top_k, normalize);
        else route_row<32>(logits, ids, weights, chosen, count, r, num_experts, top_k, normalize);
    }
    __syncthreads();
    if (warp == 0) {  // the plan's experts and offsets: lane l scans experts [l * per_lane, ...)
        const int lo = lane * per_lane, hi = min(lo + per_lane, num_experts);
        int n = 0, pairs = 0;
        for (int e = lo; e < hi; ++e) n += count[e] > 0, pairs += (int)count[e];
        lane_active[lane] = n, lane_pairs[lane] = pairs;
        __syncwarp();
        int slot = 0, offset = 0;
        for (int l = 0; l < lane; ++l) slot += lane_active[l], offset += lane_pairs[l];
        int* active = plan + 1;
        int* offsets = plan + 1 + num_experts;
        for (int e = lo; e < hi; ++e) {
            fill[e] = (unsigned)offset;
            if (count[e] > 0) active[slot] = e, offsets[slot] = offset, ++slot, offset += (int)count[e];
        }
        if (lane == 31) {
            plan[0] = slot;
            offsets[slot] = offset;
            if (experts_read != nullptr) experts_read[0] += slot;
        }
    }
    __syncthreads();
    int* pairs = plan + 2 + 2 * num_experts;
    for (int q = threadIdx.x; q < rows * top_k; q += blockDim.x) pairs[atomicAdd(&fill[chosen[q]], 1u)] = q;
}

enum MoeEpilogue { GATE_UP, DOWN };

// What a CTA of the expert kernels works on: chosen expert `e` (slot blockIdx.y of the plan) and
// the pairs [lo, hi) that chose it, over output columns in tiles of MOE_WARPS * COLS (a warp: COLS
// columns); the CTA takes tiles blockIdx.x, + gridDim.x, ... GATE_UP (COLS 1): w (E, 2n, kdim),
// column j reads rows j and n + j; the input row of pair q is row q / top_k of `in`; out: act
// (pairs, n) bf16. DOWN: w (E, n, kdim), columns j * COLS ..; input row q of `in` (act); out:
// y (pairs, n) fp32.
template <MoeEpilogue EPI, int COLS>
struct ExpertWork {
    static constexpr int R = EPI == GATE_UP ? 2 : COLS;  // weight rows per warp
    const bf16_t* w;
    const int* pairs;
    int lo, hi, n, kdim, chunks, top_k;

    __device__ int row_of(int j, int h) const { return EPI == GATE_UP ? j + h * n : j * COLS + h; }
    __device__ bool busy(int j) const { return EPI == GATE_UP ? j < n : j * COLS < n; }
    __device__ bool has(int j, int h) const { return busy(j) && (EPI == GATE_UP || row_of(j, h) < n); }

    template <int U>
    __device__ void load(Chunk (&wc)[U][R], int j, int c0) const {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int h = 0; h < R; ++h)
                if (has(j, h) && c0 + 32 * u < chunks)
                    wc[u][h] = load_weights(w + (long long)row_of(j, h) * kdim + (c0 + 32 * u) * 8);
    }

    // Stage the input rows of pairs [base, base + rows) in xs.
    __device__ void stage(Chunk* xs, const bf16_t* in, int base, int rows) const {
        for (int c = threadIdx.x; c < rows * chunks; c += blockDim.x) {
            const int q = pairs[base + c / chunks];
            const long long row = EPI == GATE_UP ? q / top_k : q;
            xs[c] = *reinterpret_cast<const Chunk*>(in + row * kdim + (c % chunks) * 8);
        }
    }

    template <int U>
    __device__ void accumulate(const Chunk (&wc)[U][R], const Chunk* xs, int c0, int rows,
                               float (&acc)[MOE_MAX_ROWS_PER_PASS][R]) const {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            if (c >= chunks) continue;
#pragma unroll
            for (int r = 0; r < MOE_MAX_ROWS_PER_PASS; ++r) {
                if (r >= rows) continue;
                const Chunk xv = xs[r * chunks + c];
#pragma unroll
                for (int h = 0; h < R; ++h) acc[r][h] = dot8(wc[u][h], xv, acc[r][h]);
            }
        }
    }

    // The warp's sums of column j for pairs [base, base + rows): reduced, stored, reset.
    __device__ void finish(float (&acc)[MOE_MAX_ROWS_PER_PASS][R], int j, int base, int rows, const float* weights,
                           void* out) const {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int r = 0; r < MOE_MAX_ROWS_PER_PASS; ++r) {
            if (r >= rows) continue;
#pragma unroll
            for (int h = 0; h < R; ++h) acc[r][h] = warp_sum(acc[r][h]);
            if (lane == 0) {
                const int q = pairs[base + r];
                if constexpr (EPI == GATE_UP) {
                    const float g = round_bf16(acc[r][0]), u = round_bf16(acc[r][1]);
                    reinterpret_cast<bf16_t*>(out)[(long long)q * n + j] =
                        f32_to_bf16(round_bf16(g / (1.0f + expf(-g))) * u);
                } else {
                    const float wq = round_bf16(weights[q]);
#pragma unroll
                    for (int h = 0; h < R; ++h)
                        if (has(j, h))
                            reinterpret_cast<float*>(out)[(long long)q * n + row_of(j, h)] =
                                round_bf16(round_bf16(acc[r][h]) * wq);
                }
            }
#pragma unroll
            for (int h = 0; h < R; ++h) acc[r][h] = 0.0f;
        }
    }
};

// Per tile, the expert's pairs a pass at a time (all of them in one pass for up to
// MOE_MAX_ROWS_PER_PASS rows), the weights read in batches of 32 * U chunks of a row.
template <MoeEpilogue EPI, int COLS, int U>
__device__ void expert_passes(const ExpertWork<EPI, COLS>& x, Chunk* xs, const bf16_t* in, const float* weights,
                              void* out, int tiles, int per_pass) {
    constexpr int R = ExpertWork<EPI, COLS>::R;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int j = t * MOE_WARPS + warp;
        for (int base = x.lo; base < x.hi; base += per_pass) {
            const int rows = min(per_pass, x.hi - base);
            __syncthreads();  // the previous pass has read xs
            x.stage(xs, in, base, rows);
            __syncthreads();
            if (!x.busy(j)) continue;
            float acc[MOE_MAX_ROWS_PER_PASS][R];
#pragma unroll
            for (int r = 0; r < MOE_MAX_ROWS_PER_PASS; ++r)
#pragma unroll
                for (int h = 0; h < R; ++h) acc[r][h] = 0.0f;
            for (int c0 = lane; c0 < x.chunks; c0 += 32 * U) {
                Chunk wc[U][R];
                x.load(wc, j, c0);
                x.accumulate(wc, xs, c0, rows, acc);
            }
            x.finish(acc, j, base, rows, weights, out);
        }
    }
}

// The CTA's expert and pairs from the plan; false when its slot is past the chosen experts.
template <MoeEpilogue EPI, int COLS, int U>
__device__ bool run_expert(const bf16_t* w_all, const bf16_t* in, const int* plan, const float* weights, void* out,
                           int n, int kdim, int num_experts, int top_k) {
    __shared__ Chunk xs[MOE_STAGE_ELEMS / 8];
    const int slot = blockIdx.y, chosen = plan[0];
    const int e = plan[1 + slot], lo = plan[1 + num_experts + slot], hi = plan[2 + num_experts + slot];
    if (slot >= chosen) return false;  // the whole CTA: no barrier is skipped by part of it
    ExpertWork<EPI, COLS> x{w_all + (long long)e * (EPI == GATE_UP ? 2 : 1) * n * kdim, plan + 2 + 2 * num_experts,
                            lo, hi, n, kdim, kdim / 8, top_k};
    const int tiles = (n + MOE_WARPS * COLS - 1) / (MOE_WARPS * COLS);
    const int per_pass = min(MOE_MAX_ROWS_PER_PASS, MOE_STAGE_ELEMS / kdim);
    expert_passes<EPI, COLS, U>(x, xs, in, weights, out, tiles, per_pass);
    return true;
}

// act (rows * top_k, inter) = silu(gate_e · x) * (up_e · x) for each pair's expert e.
// gate_up (E, 2 * inter, hidden); hidden % 8 == 0, hidden <= MOE_STAGE_ELEMS.
// grid (any up to ceil(inter / MOE_WARPS), min(E, rows * top_k)), block MOE_THREADS.
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_gate_up_bf16(const bf16_t* x, const bf16_t* gate_up, const int* plan, bf16_t* act, int hidden, int inter,
                     int num_experts, int top_k) {
    pdl_wait();
    pdl_launch_dependents();
    run_expert<GATE_UP, 1, 4>(gate_up, x, plan, nullptr, act, inter, hidden, num_experts, top_k);
}

// y (rows * top_k, hidden) fp32 = bf16(bf16(down_e · act) * bf16(weight)) for each pair; then the
// last CTA of each blockIdx.x to finish (counters: zeroed words, one per blockIdx.x, left zero)
// writes out (rows, hidden) = bf16(sum over the row's slots of y, in slot order) [then
// bf16(residual + that)] for the columns of its tiles. out may alias residual. down (E, hidden,
// inter); inter % 8 == 0, inter <= MOE_STAGE_ELEMS. grid (any up to ceil(hidden / (MOE_WARPS *
// MOE_DOWN_COLS)), min(E, rows * top_k)), block MOE_THREADS.
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_down_bf16(const bf16_t* act, const bf16_t* down, const int* plan, const float* weights, float* y,
                  const bf16_t* residual, bf16_t* out, unsigned* counters, int rows, int hidden, int inter,
                  int num_experts, int top_k) {
    __shared__ bool last;
    pdl_wait();
    pdl_launch_dependents();
    if (!run_expert<DOWN, MOE_DOWN_COLS, 3>(down, act, plan, weights, y, hidden, inter, num_experts, top_k)) return;
    __syncthreads();  // this CTA's y is written
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counters + blockIdx.x, 1u) == (unsigned)plan[0] - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int width = MOE_WARPS * MOE_DOWN_COLS, tiles = (hidden + width - 1) / width;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x)
        for (int i = threadIdx.x; i < rows * width; i += blockDim.x) {
            const int r = i / width, c = t * width + i % width;
            if (c >= hidden) continue;
            float s = 0.0f;
            for (int q = 0; q < top_k; ++q) s += __ldcg(y + ((long long)r * top_k + q) * hidden + c);
            s = round_bf16(s);
            if (residual != nullptr) s = bf16_to_f32(residual[(long long)r * hidden + c]) + s;
            out[(long long)r * hidden + c] = f32_to_bf16(s);
        }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}
