// The routed experts of a MoE FFN for a few rows (decode, short prefill chunks), in three launches
// that read each chosen expert's weights once however many rows chose it, and keep every expert
// id on the device (graph-captured, no host sync):
//   moe_route_bf16     one CTA: each row's top-k of the router's logits (the softmax's top k;
//                      ties to the lower expert id, as torch.topk), weighted by the softmax,
//                      renormalized when asked; then the
//                      plan: the experts some row chose, ascending (one row: in slot order), and
//                      each one's (row, slot) pairs; and the count of experts read.
//   moe_router_bf16    batch 1: the FFN's RMSNorm, the router's GEMV and moe_route_bf16's work
//                      in one launch (the last CTA routes once every logit is stored).
//   moe_gate_up_bf16   per chosen expert and 16 columns of its width: silu(gate·x) * (up·x) for
//                      every pair that chose it -> act (tensor cores). moe_gate_up_one_bf16:
//                      the same for batch 1, more of a warp's weight loads in flight.
//   moe_down_bf16      per chosen expert and 16 hidden columns: w * (down·act) for each pair -> y;
//                      the last CTA of a column tile sums each row's top-k slots in slot order
//                      [+ residual] -> out (tensor cores).
//   moe_down_one_bf16  batch 1: moe_down_bf16's out with a CTA per 16 hidden columns taking every
//                      slot (no y in global memory, no counter), the same sums in the same order.
// Every output of a pair depends on that pair's row alone, and each row's sum runs in slot order,
// so a row's result does not depend on the other rows of the batch. Rounding follows HF's bf16
// expert loop where it stores: gate, up, silu(gate), the product, down's output, its product with
// the bf16 weight; the k products are summed in fp32 and rounded once (HF adds them in bf16).
//
// Prefill chunks (more rows) group their pairs by expert for torch's grouped GEMMs, with two launches
// of their own around them:
//   moe_route_rows_bf16  a warp per row: route_row's top-k and weights, each expert's pair count.
//   moe_combine_bf16     a CTA per row: the row's top-k outputs, found in the grouped order,
//                        weighted and summed in slot order [+ residual] -> out.
//
// A shared expert (Qwen2-MoE, Qwen3-Next) rides along as `shared` more experts: its width W cut
// into chunks of the routed experts' width I (the last one short when I does not divide W), ids
// E .. E + shared - 1 after the routed ones. The routing gives every row those slots after its
// top k, each weighted sigmoid(the shared gate's logit, one more router row), and the expert
// kernels read a chunk's rows from the shared expert's own tensors as they read a chosen expert's,
// so the shared expert costs no launch of its own. Below, k counts a row's slots (top_k + shared)
// and E the experts (routed + shared) where the plan and the expert kernels are concerned.
//
// The plan (int32): plan[0] = chosen experts n; plan[1 .. 1+E) their ids, ascending (one row: in
// slot order, so entry s is slot s's); plan[1+E .. 2+2E) offsets (n + 1 entries) into the pairs
// plan[2+2E ..), each the index row * k + slot. No expert kernel's value depends on the order.
#include "cluster.cuh"
#include "gemv.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "timeline.cuh"

#define MOE_THREADS 256  // moe_combine_bf16's CTA
#define MOE_ROUTE_THREADS 512
#define MOE_MAX_EXPERTS 1024
#define MOE_MAX_PAIRS 1024  // rows * top_k of one launch

// A router logit: written by another CTA of the launch (through L2), or gathered into this CTA's
// shared memory (moe_router_bf16 in a cluster).
__device__ __forceinline__ bf16_t load_logit(const bf16_t* p) {
#ifndef METRALE_HOST_EMULATION
    if (__isShared(p)) return *p;
#endif
    return __ldcg(p);
}

// moe_router_bf16 over more CTAs than a cluster: each CTA stores its logits into words that hold
// LOGIT_PENDING (a NaN's bits that f32_to_bf16, which stores NaN as 0x7fc0, never writes), and the
// routing warp loads the row's logits again until none is pending, then sets them back to pending
// for the next launch. That launch's CTAs store only after their wait, and so after this one has
// completed: no counter, and its trip, between the last logit stored and the routing.
#define LOGIT_PENDING 0xffffu
#define LOGIT_POLLS (1 << 22)  // rounds of loads before the routing warp gives up (a trap, not a hang)

__device__ __forceinline__ void store_logit(bf16_t* p, bf16_t v) {
#if !defined(METRALE_HOST_EMULATION) && defined(__CUDA_ARCH__)
    asm volatile("st.relaxed.gpu.global.b16 [%0], %1;" ::"l"(p), "h"(v) : "memory");
#else
    *p = v;
#endif
}

// A lane's logits of the row (expert lane + 32 v, below num_experts; the shared gate's after
// them with `gate`) once every one is stored, the words set back to pending.
template <int V>
__device__ __forceinline__ void poll_logits(bf16_t* row, int num_experts, bool gate, bf16_t (&raw)[V],
                                            bf16_t& gate_raw) {
    const int lane = threadIdx.x & 31;
    unsigned pending = 0u;
#pragma unroll
    for (int v = 0; v < V; ++v) {
        raw[v] = (bf16_t)LOGIT_PENDING;
        if (lane + 32 * v < num_experts) pending |= 1u << v;
    }
    gate_raw = (bf16_t)LOGIT_PENDING;
    bool gate_pending = gate;
    for (int polls = 0;; ++polls) {
#pragma unroll
        for (int v = 0; v < V; ++v)  // every pending word's load issued before any is compared
            if (pending >> v & 1u) raw[v] = load_in_order(row + lane + 32 * v);
        if (gate_pending) gate_raw = load_in_order(row + num_experts);
#pragma unroll
        for (int v = 0; v < V; ++v)
            if (raw[v] != LOGIT_PENDING) pending &= ~(1u << v);
        gate_pending = gate_pending && gate_raw == LOGIT_PENDING;
        if (!__reduce_max_sync(0xffffffffu, (unsigned)(pending != 0u || gate_pending))) break;
        if (polls == LOGIT_POLLS) {
#ifdef METRALE_HOST_EMULATION
            std::abort();
#else
            __trap();
#endif
        }
    }
#pragma unroll
    for (int v = 0; v < V; ++v)
        if (lane + 32 * v < num_experts) store_logit(row + lane + 32 * v, (bf16_t)LOGIT_PENDING);
    if (gate && lane == 0) store_logit(row + num_experts, (bf16_t)LOGIT_PENDING);
}

// Expert e's routing key: its bf16 logit's bits mapped to a 16-bit unsigned order (-0 taken as +0,
// so that the two tie), a < b exactly where order(a) < order(b), above 0xffff - e. Keys are
// distinct, larger logits give larger keys, and equal logits rank the lower id first (torch.topk's
// order among equals). Every key is above 0, which stands for no expert.
__device__ __forceinline__ unsigned logit_key(bf16_t logit, int e) {
    const unsigned u = logit == 0x8000u ? 0u : logit;
    const unsigned order = (u & 0x8000u) ? (~u & 0xffffu) : (u | 0x8000u);
    return order << 16 | (0xffffu - (unsigned)e);
}

__device__ __forceinline__ float key_logit(unsigned key) {
    const unsigned order = key >> 16;
    return bf16_to_f32((bf16_t)((order & 0x8000u) ? (order & 0x7fffu) : (~order & 0xffffu)));
}

__device__ __forceinline__ int key_expert(unsigned key) { return (int)(0xffffu - (key & 0xffffu)); }

// A lane's V keys sorted, largest first (a bitonic network: constant indices, so they stay in
// registers).
template <int V>
__device__ __forceinline__ void sort_descending(unsigned (&key)[V]) {
#pragma unroll
    for (int size = 2; size <= V; size <<= 1)
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1)
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const int j = i ^ stride;
                if (j > i) {
                    const unsigned hi = key[i] > key[j] ? key[i] : key[j], lo = key[i] > key[j] ? key[j] : key[i];
                    const bool down = (i & size) == 0;  // this run sorts largest first
                    key[i] = down ? hi : lo;
                    key[j] = down ? lo : hi;
                }
            }
}

// One row's routing by one warp, V = ceil(E / 32) logits a lane (expert lane + 32 v). The softmax
// is monotone, so the top k of its probabilities are the top k of the logits. Each lane sorts its
// experts' keys (logit_key: the logit above the id), then each of k rounds takes the warp's
// largest head by one reduction, and the lane that held it moves its next key up. Lane s keeps
// slot s. Its weight is exp(l_s - m) (m the largest logit) over the k slots' sum when normalized,
// which is HF's p_s / sum of the k p's with the softmax's denominator cancelled, else over the sum
// of every expert's exp(l - m): the row's exponentials are taken only there, and a lane divides
// once. Where `count` is given (null: one row's plan, which needs neither), the chosen ids also go
// to `chosen` and are counted per expert after the rounds. With `shared` slots the row's logits
// hold one more, the shared expert's gate, after the E routed ones (loaded with the others); the
// row's slots top_k .. top_k + shared - 1 are the shared expert's chunks E .. E + shared - 1, each
// weighted sigmoid(gate). Returns the lane's expert id (lanes below top_k).
template <int V>
__device__ int route_row(const bf16_t* logits, int* ids, float* weights, int* chosen, unsigned* count, int r,
                         int num_experts, int top_k, int shared, int normalize, bool poll TL_ROW_PARAM) {
    const int lane = threadIdx.x & 31;
    const int slots = top_k + shared;
    const bf16_t* row = logits + (long long)r * (num_experts + (shared > 0));
    unsigned key[V];
    bf16_t gate_logit = 0;
    if (poll) {
        bf16_t raw[V];
        poll_logits(const_cast<bf16_t*>(row), num_experts, shared > 0, raw, gate_logit);
#pragma unroll
        for (int v = 0; v < V; ++v) key[v] = lane + 32 * v < num_experts ? logit_key(raw[v], lane + 32 * v) : 0u;
    } else {
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int e = lane + 32 * v;
            key[v] = e < num_experts ? logit_key(load_logit(row + e), e) : 0u;
        }
        if (shared > 0) gate_logit = load_logit(row + num_experts);
    }
    float z = 0.0f;  // the sum of every expert's exp(l - m), where not normalized
    if (!normalize) {
        unsigned top = 0u;
#pragma unroll
        for (int v = 0; v < V; ++v) top = key[v] > top ? key[v] : top;
        const float m = key_logit(__reduce_max_sync(0xffffffffu, top));
#pragma unroll
        for (int v = 0; v < V; ++v) z += key[v] != 0u ? expf(key_logit(key[v]) - m) : 0.0f;
        z = warp_sum(z);
    }
#if defined(METRALE_TIMELINE) && TL_MARKS > 6
    if (tl_row != nullptr) {  // the nine-mark build's mark 6 waits for every key (tools/decode_timeline.py)
        unsigned all = 0u;
#pragma unroll
        for (int v = 0; v < V; ++v) all ^= key[v];
        asm volatile("" ::"r"(all));
        tl_row[6] = tl_now();
    }
#endif
    sort_descending(key);
    TL_ROW_MARK(7);
    unsigned mine = 0u, first = 0u;
    for (int s = 0; s < top_k; ++s) {
        const unsigned best = __reduce_max_sync(0xffffffffu, key[0]);
        if (key[0] == best) {  // this lane's head taken: its next key moves up
#pragma unroll
            for (int v = 0; v + 1 < V; ++v) key[v] = key[v + 1];
            key[V - 1] = 0u;
        }
        if (s == 0) first = best;
        if (lane == s) mine = best;
    }
    TL_ROW_MARK(8);
    const int mine_id = key_expert(mine);
    const float e = lane < top_k ? expf(key_logit(mine) - key_logit(first)) : 0.0f;
    const float total = normalize ? warp_sum(e) : z;
    if (lane < top_k) {
        ids[r * slots + lane] = mine_id;
        weights[r * slots + lane] = e / total;
        if (count != nullptr) {
            chosen[r * slots + lane] = mine_id;
            atomicAdd(&count[mine_id], 1u);
        }
    }
    if (shared > 0) {
        const float gate = 1.0f / (1.0f + expf(-bf16_to_f32(gate_logit)));
        for (int j = lane; j < shared; j += 32) {
            const int q = r * slots + top_k + j;
            ids[q] = num_experts + j;
            weights[q] = gate;
            if (count != nullptr) {
                chosen[q] = num_experts + j;
                atomicAdd(&count[num_experts + j], 1u);
            }
        }
    }
    return mine_id;
}

// route_row with V sized to the experts a lane holds.
__device__ int route_row_any(const bf16_t* logits, int* ids, float* weights, int* chosen, unsigned* count, int r,
                             int num_experts, int top_k, int shared, int normalize, bool poll TL_ROW_PARAM) {
    const int per_lane = (num_experts + 31) / 32;
#define ROUTE_ROW(V) \
    route_row<V>(logits, ids, weights, chosen, count, r, num_experts, top_k, shared, normalize, poll TL_ROW_ARG)
    if (per_lane <= 4) return ROUTE_ROW(4);
    if (per_lane <= 8) return ROUTE_ROW(8);
    if (per_lane <= 16) return ROUTE_ROW(16);
    return ROUTE_ROW(32);
#undef ROUTE_ROW
}

// The routing CTA's shared scratch: each pair's expert, each expert's pair count and fill.
struct RouteScratch {
    int chosen[MOE_MAX_PAIRS];
    unsigned count[MOE_MAX_EXPERTS];
    unsigned fill[MOE_MAX_EXPERTS];
    int lane_active[32], lane_pairs[32];
};

// moe_route_bf16's work, by the whole CTA (a warp per row at a time): every row routed, then the
// plan over the E + shared experts and experts_read (rows >= 1). One row (batch 1) has a pair an
// expert, so warp 0 writes the plan in slot order (plan entry s: slot s's expert and pair) instead
// of counting and scanning every expert: the expert kernels' values do not depend on the plan's
// order (each pair's act row and y are its own; the down sums a row's slots in slot order).
__device__ void route_plan(const bf16_t* logits, int* ids, float* weights, int* plan, long long* experts_read,
                           int rows, int num_experts, int top_k, int shared, int normalize, bool poll,
                           RouteScratch& sh TL_ROW_PARAM) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int total = num_experts + shared, per_lane = (total + 31) / 32, slots = top_k + shared;
    int* chosen = sh.chosen;
    unsigned *count = sh.count, *fill = sh.fill;
    if (rows == 1 && slots <= 32) {  // one pair an expert: the plan is the row's slots in slot order
        if (warp != 0) return;
        const int routed = route_row_any(logits, ids, weights, nullptr, nullptr, 0, num_experts, top_k, shared,
                                         normalize, poll TL_ROW_ARG);
        if (lane < slots) {
            plan[1 + lane] = lane < top_k ? routed : num_experts + lane - top_k;  // slot `lane`'s expert
            plan[1 + total + lane] = lane;
            plan[2 + 2 * total + lane] = lane;
        }
        if (lane == 0) {
            plan[0] = slots;
            plan[1 + total + slots] = slots;
            if (experts_read != nullptr)  // a reduction: the lane does not wait for the old value
                atomicAdd(reinterpret_cast<unsigned long long*>(experts_read), (unsigned long long)top_k);
        }
        return;
    }
    for (int e = threadIdx.x; e < total; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int r = warp; r < rows; r += warps)
        route_row_any(logits, ids, weights, chosen, count, r, num_experts, top_k, shared, normalize, poll);
    __syncthreads();
    if (warp == 0) {  // the plan's experts and offsets: lane l scans experts [l * per_lane, ...)
        const int lo = lane * per_lane, hi = min(lo + per_lane, total);
        int n = 0, pairs = 0;
        for (int e = lo; e < hi; ++e) n += count[e] > 0, pairs += (int)count[e];
        sh.lane_active[lane] = n, sh.lane_pairs[lane] = pairs;
        __syncwarp();
        int slot = 0, offset = 0;
        for (int l = 0; l < lane; ++l) slot += sh.lane_active[l], offset += sh.lane_pairs[l];
        int* active = plan + 1;
        int* offsets = plan + 1 + total;
        for (int e = lo; e < hi; ++e) {
            fill[e] = (unsigned)offset;
            if (count[e] > 0) active[slot] = e, offsets[slot] = offset, ++slot, offset += (int)count[e];
        }
        if (lane == 31) {
            plan[0] = slot;
            offsets[slot] = offset;
            if (experts_read != nullptr) experts_read[0] += slot - shared;  // routed experts: every row has the chunks
        }
    }
    __syncthreads();
    int* pairs = plan + 2 + 2 * total;
    for (int q = threadIdx.x; q < rows * slots; q += blockDim.x) pairs[atomicAdd(&fill[chosen[q]], 1u)] = q;
}

// logits (rows, E [+ 1]) bf16 -> ids (rows, k + shared) int32, weights (rows, k + shared) fp32,
// the plan, experts_read[0] += n - shared (the routed experts read). rows * (k + shared) <= MOE_MAX_PAIRS, E + shared <=
// MOE_MAX_EXPERTS, k <= min(E, 32). grid 1, block: up to MOE_ROUTE_THREADS, a multiple of 32 (a
// warp per row at a time).
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS)
    moe_route_bf16(const bf16_t* logits, int* ids, float* weights, int* plan, long long* experts_read, int rows,
                   int num_experts, int top_k, int shared, int normalize) {
    __shared__ RouteScratch sh;
    pdl_wait();
    pdl_launch_dependents();
    route_plan(logits, ids, weights, plan, experts_read, rows, num_experts, top_k, shared, normalize, false, sh);
}

// Batch-1 decode's norm, router and routing in one launch (rms_norm_bf16, the router's GEMV and
// moe_route_bf16 fused): x = RMSNorm(h), staged as gemv_norm_bf16 stages it (rms_norm_bf16's
// arithmetic) and stored to x_out by CTA 0; logits (E,) bf16 = router · x, a warp per expert in
// gemv_norm_bf16's order (each logit is the value that kernel stores); then the grid's last CTA
// routes the row as moe_route_bf16 does, its scratch in the staged row's shared memory, once it
// has loaded every logit (poll_logits: logits holds LOGIT_PENDING words, and is left so), the
// others leaving as soon as theirs are stored. Launched as one cluster (grid <= MOE_ROUTER_CLUSTER), CTA 0
// routes instead, after a cluster barrier, from the logits it gathers from the CTAs' shared
// memory: no counter, and no logits in global memory (logits is left unwritten). The router rows
// are loaded before the PDL wait (a constant).
// router (E [+ 1 with shared slots: the shared expert's gate], hidden) bf16; hidden % 8 == 0,
// hidden <= GEMV_MAX_K, every pointer 16-byte aligned; E + shared <= MOE_MAX_EXPERTS, k <= min(E,
// 32). grid ceil(router rows / GEMV_WARPS), block GEMV_THREADS.
#define ROUTER_U 8  // chunks a lane per batch: gemv_norm_bf16's U
#define MOE_ROUTER_CLUSTER 16  // the most CTAs of a router launched as one cluster
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
    moe_router_bf16(const bf16_t* router, const bf16_t* h, const bf16_t* gamma, bf16_t* x_out, bf16_t* logits,
                    int* ids, float* weights, int* plan, long long* experts_read, int num_experts, int hidden,
                    int top_k, int shared, int normalize, float eps) {
    static_assert(sizeof(RouteScratch) <= GEMV_MAX_K / 8 * sizeof(Chunk), "the route's scratch fits the row's");
    __shared__ Chunk xs[GEMV_MAX_K / 8];
    __shared__ float mine[GEMV_WARPS];  // in a cluster: this CTA's logits
    __shared__ bf16_t gathered[MOE_ROUTER_CLUSTER * GEMV_WARPS];  // CTA 0 of a cluster: every logit
    TL_BEGIN(0);
    const int lane = threadIdx.x & 31, e = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int chunks = hidden / 8, num_logits = num_experts + (shared > 0);
    const bool clustered = cluster_ctas() > 1;
    const bf16_t* row = router + (long long)e * hidden;
    Chunk first[ROUTER_U];
#pragma unroll
    for (int u = 0; u < ROUTER_U; ++u) {
        const int ci = lane + 32 * u;
        if (e < num_logits && ci < chunks) first[u] = load_weights(row + ci * 8);
    }
    const EarlyGamma early = early_gamma<true>(gamma, hidden);
    pdl_wait();
    pdl_launch_dependents();
    TL_MARK(1);
    stage_x<true>(xs, h, nullptr, gamma, nullptr, hidden, eps, &early);
    TL_MARK(2);
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < chunks; i += blockDim.x) reinterpret_cast<Chunk*>(x_out)[i] = xs[i];
    }
    if (e < num_logits) {
        float acc = 0.0f;
        for (int b = 0; b * 32 * ROUTER_U < chunks; ++b) {
            Chunk c[ROUTER_U];
#pragma unroll
            for (int u = 0; u < ROUTER_U; ++u) {
                const int ci = lane + 32 * (b * ROUTER_U + u);
                if (ci < chunks) c[u] = b == 0 ? first[u] : load_weights(row + ci * 8);
            }
#pragma unroll
            for (int u = 0; u < ROUTER_U; ++u) {
                const int ci = lane + 32 * (b * ROUTER_U + u);
                if (ci < chunks) acc = dot8(c[u], xs[ci], acc);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) {  // a cluster's logits stay in shared memory: no global store for its barrier to wait on
            if (!clustered) store_logit(logits + e, f32_to_bf16(acc));
            mine[threadIdx.x >> 5] = round_bf16(acc);
        }
    }
    __syncthreads();  // every logit of the CTA stored, xs no longer read
    TL_MARK(3);
    if (clustered) {  // the grid is one cluster
        const bool first = cluster_rank() == 0;
        cluster_sync();  // every CTA's logits in its shared memory
        if (first) {
            for (int i = threadIdx.x; i < num_logits; i += blockDim.x)
                gathered[i] = f32_to_bf16(cluster_load(&mine[i % GEMV_WARPS], i / GEMV_WARPS));
            __syncthreads();
        }
        cluster_arrive_relaxed();  // CTA 0 has read every logit: the others may leave
        TL_MARK(4);
        if (first) route_plan(gathered, ids, weights, plan, experts_read, 1, num_experts, top_k, shared, normalize,
                              false, *reinterpret_cast<RouteScratch*>(xs) TL_ROW_HERE);
        cluster_wait();
        TL_MARK(5);
        return;
    }
    if (blockIdx.x != gridDim.x - 1) {  // the last CTA routes, once every logit is stored (poll_logits)
        TL_MARK(5);
        return;
    }
    TL_MARK(4);
    route_plan(logits, ids, weights, plan, experts_read, 1, num_experts, top_k, shared, normalize, true,
               *reinterpret_cast<RouteScratch*>(xs) TL_ROW_HERE);
    TL_MARK(5);
}

// logits (rows, E [+ 1]) bf16 -> ids, weights (rows, k + shared) as moe_route_bf16's; counts[e]
// += the pairs that chose e (E + shared entries, zeroed by the caller). E + shared <=
// MOE_MAX_EXPERTS, k <= min(E, 32). grid ceil(rows / (block / 32)), block a multiple of 32: a
// warp per row.
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS)
    moe_route_rows_bf16(const bf16_t* logits, int* ids, float* weights, unsigned* counts, int rows, int num_experts,
                        int top_k, int shared, int normalize) {
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    pdl_wait();
    pdl_launch_dependents();
    if (r >= rows) return;
    route_row_any(logits, ids, weights, ids, counts, r, num_experts, top_k, shared, normalize, false);
}

// out (rows, hidden) = bf16(sum over slots s, in order, of bf16(ys[where[r * k + s]] * bf16(weights[r *
// k + s]))) [then bf16(residual + that)]: the rounding of moe_down_bf16's epilogue and its sum.
// ys (rows * k, hidden) bf16, the pairs' expert outputs in the grouped order; where: each pair's
// row in it. hidden % 8 == 0; out may alias residual. grid rows, block a multiple of 32.
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_combine_bf16(const bf16_t* ys, const int* where, const float* weights, const bf16_t* residual, bf16_t* out,
                     int hidden, int top_k) {
    const long long r = blockIdx.x;
    pdl_wait();
    pdl_launch_dependents();
    for (int c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {
        float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int q = 0; q < top_k; ++q) {
            const float wq = round_bf16(weights[r * top_k + q]);
            float y[8];
            load_vec<8>(ys + (long long)where[r * top_k + q] * hidden + c, y);
#pragma unroll
            for (int i = 0; i < 8; ++i) s[i] += round_bf16(y[i] * wq);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] = round_bf16(s[i]);
        if (residual != nullptr) {
            float res[8];
            load_vec<8>(residual + r * hidden + c, res);
#pragma unroll
            for (int i = 0; i < 8; ++i) s[i] += res[i];
        }
        store_vec<8>(out + r * hidden + c, s);
    }
}

// The expert kernels' dot products run on tensor cores. A CTA takes 16 weight rows of its expert
// (16 columns of its width for gate/up, of hidden for down) and every pair that chose the expert,
// a pass of up to MOE_TC_PAIRS pairs at a time; its MOE_TC_WARPS warps split the K dimension in blocks of 64 (warp w: blocks w, w + 4, ..)
// and warp 0 adds their sums in warp order. A warp's m16n8k16 step: A = 16 weight rows, B = 8
// pairs' input rows. Lane 4g + c loads the 16 elements 16c .. 16c + 15 of a 64-element block of
// weight rows g and g + 8 and of pair g's input row; its four steps of the block take elements
// 4i .. 4i + 3 of those (logical k 2c, 2c + 1, 2c + 8, 2c + 9 of step i): a permutation of K that
// A and B share, so the loads stay 16 bytes wide and no operand is shuffled.
#define MOE_TC_WARPS 4
#define MOE_TC_THREADS (MOE_TC_WARPS * 32)
#define MOE_TC_ROWS 16  // weight rows (output columns) per CTA
#define MOE_TC_NT 2  // 8-pair tiles per pass
#define MOE_TC_PAIRS (8 * MOE_TC_NT)
#ifndef MOE_GATE_UP_ONE_DEPTH
#define MOE_GATE_UP_ONE_DEPTH 2  // weight blocks a warp's ring holds in moe_gate_up_one_bf16
#endif

struct Block16 {  // a lane's 16 elements of a 64-element K block: two 16-byte chunks
    Chunk c[2];
};

__device__ __forceinline__ Block16 load_block(const bf16_t* row, int k0, int kdim, bool valid, bool stream) {
    Block16 b;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int k = k0 + 8 * h;
        if (valid && k < kdim) b.c[h] = stream ? load_weights(row + k) : *reinterpret_cast<const Chunk*>(row + k);
        else b.c[h] = Chunk{{0u, 0u, 0u, 0u}};
    }
    return b;
}

// Words 2i and 2i + 1 of the lane's 16 elements: step i's k pairs (2c, 2c + 1) and (2c + 8, 2c + 9).
__device__ __forceinline__ unsigned block_word(const Block16& b, int w) { return b.c[w >> 2].w[w & 3]; }

// TILES weight tiles of 16 rows share the B operand (gate/up: the gate rows and the up rows).
// SLOT_PAIRS: the plan is one row's, in slot order, so pair p is p and `pairs` is not read.
template <int TILES, bool SLOT_PAIRS = false>
struct TcWork {
    const bf16_t* w;     // the expert's weight rows: ld elements apart, the first wk of each read
    const bf16_t* in;    // input rows (kdim elements each)
    const int* pairs;
    int row0[TILES];     // first weight row of each tile
    int rows_valid;      // weight rows of a tile in range: j0 + g < n
    int j0, n, kdim, ld, wk, top_k, lo, hi;
    bool input_by_row;   // gate/up: a pair's input is row q / top_k of `in`; down: row q

    // This lane's share of weight block kb (the A operand), as pass loads it: rows g and g + 8 of
    // each tile, 16 elements of the block; zeros past the rows in range, nothing read past the last
    // block.
    __device__ void load_a(Block16 (&a)[TILES][2], int kb) const {
        const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
        const int blocks = (kdim + 63) / 64, k0 = kb * 64 + 16 * c;
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                a[t][h] = load_block(w + (long long)(row0[t] + g + 8 * h) * ld, k0, wk,
                                     kb < blocks && g + 8 * h < rows_valid, true);
    }

    // acc[t][nt][4]: the sums over K blocks part, part + MOE_TC_WARPS, .. (the CTA's warp by
    // default) for the pass's pairs [base, base + MOE_TC_PAIRS). The weight blocks are a ring of
    // DEPTH in registers: block i + DEPTH - 1's loads are issued before block i's MMAs, so a warp
    // has DEPTH - 1 blocks in flight while it multiplies (DEPTH 1: load, then multiply). The sums'
    // order is the same for every DEPTH.
    template <int DEPTH>
    __device__ void pass(int base, float (&acc)[TILES][MOE_TC_NT][4], int part = threadIdx.x >> 5) const {
        Block16 none[TILES][2];
        pass<DEPTH>(base, acc, part, none, false);
    }

    // The same with block `part` as load_a loaded it earlier (before a PDL wait) into `first`,
    // where `loaded` (DEPTH 1), not loaded again.
    template <int DEPTH>
    __device__ void pass(int base, float (&acc)[TILES][MOE_TC_NT][4], int part, const Block16 (&first)[TILES][2],
                         bool loaded) const {
        const int lane = threadIdx.x & 31, warp = part, g = lane >> 2, c = lane & 3;
        const int blocks = (kdim + 63) / 64;
        const int npairs = min(MOE_TC_PAIRS, hi - base);
        const bf16_t* xrow[MOE_TC_NT];
#pragma unroll
        for (int nt = 0; nt < MOE_TC_NT; ++nt) {
            const int p = base + nt * 8 + g;
            const int q = p >= hi ? 0 : SLOT_PAIRS ? p : pairs[p];
            xrow[nt] = p < hi ? in + (long long)(input_by_row ? q / top_k : q) * kdim : nullptr;
        }
        const bf16_t* wrow[TILES][2];
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) wrow[t][h] = w + (long long)(row0[t] + g + 8 * h) * ld;
        const bool valid[2] = {g < rows_valid, g + 8 < rows_valid};
        auto load = [&](Block16 (&a)[TILES][2], int kb) {  // nothing is read past the last block
            const int k0 = kb * 64 + 16 * c;
#pragma unroll
            for (int t = 0; t < TILES; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h) a[t][h] = load_block(wrow[t][h], k0, wk, kb < blocks && valid[h], true);
        };
        auto multiply = [&](const Block16 (&a)[TILES][2], int kb) {
            const int k0 = kb * 64 + 16 * c;
#pragma unroll
            for (int nt = 0; nt < MOE_TC_NT; ++nt) {
                if (nt * 8 >= npairs) continue;  // warp-uniform
                const Block16 b = load_block(xrow[nt], k0, kdim, xrow[nt] != nullptr, false);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const unsigned bw[2] = {block_word(b, 2 * i), block_word(b, 2 * i + 1)};
#pragma unroll
                    for (int t = 0; t < TILES; ++t) {
                        const unsigned aw[4] = {block_word(a[t][0], 2 * i), block_word(a[t][1], 2 * i),
                                                block_word(a[t][0], 2 * i + 1), block_word(a[t][1], 2 * i + 1)};
                        mma_bf16_16816(acc[t][nt], aw, bw);
                    }
                }
            }
        };
        Block16 a[DEPTH][TILES][2];
#pragma unroll
        for (int s = 0; s < DEPTH - 1; ++s) load(a[s], warp + s * MOE_TC_WARPS);
        for (int kb0 = warp; kb0 < blocks; kb0 += DEPTH * MOE_TC_WARPS) {
#pragma unroll
            for (int s = 0; s < DEPTH; ++s) {  // ring slots by constant index: they stay in registers
                const int kb = kb0 + s * MOE_TC_WARPS;
                if (DEPTH == 1 && loaded && kb == warp) {
#pragma unroll
                    for (int t = 0; t < TILES; ++t) a[0][t][0] = first[t][0], a[0][t][1] = first[t][1];
                } else {
                    load(a[(s + DEPTH - 1) % DEPTH], kb + (DEPTH - 1) * MOE_TC_WARPS);
                }
                if (kb < blocks) multiply(a[s], kb);
            }
        }
    }
};

// The warps' sums added in warp order into warp 0's acc (the other warps' acc are left as they were).
template <int TILES>
__device__ void tc_reduce(float (&acc)[TILES][MOE_TC_NT][4], float* red) {
    constexpr int N = TILES * MOE_TC_NT * 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp > 0) {
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int nt = 0; nt < MOE_TC_NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) red[((warp - 1) * N + (t * MOE_TC_NT + nt) * 4 + i) * 32 + lane] = acc[t][nt][i];
    }
    __syncthreads();
    if (warp == 0) {
        for (int w = 1; w < MOE_TC_WARPS; ++w)
#pragma unroll
            for (int t = 0; t < TILES; ++t)
#pragma unroll
                for (int nt = 0; nt < MOE_TC_NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        acc[t][nt][i] += red[((w - 1) * N + (t * MOE_TC_NT + nt) * 4 + i) * 32 + lane];
    }
    __syncthreads();  // red is free for the next pass
}

// Where expert e's weights are: a routed expert's in the stacked tensors; the shared expert's chunk
// c = e - (E - chunks) in its own (2W, H) gate/up = [gate; up] and (H, W) down, its rows or
// columns [cI, cI + I) (fewer in the last chunk: `valid`, the rest read as zeros).
struct ExpertRows {
    const bf16_t* w;  // gate/up: the gate rows; down: the first column of row 0
    int up;           // gate/up: the up rows' offset from the gate rows, in rows
    int ld;           // down: elements between rows
    int valid;        // rows (gate/up) or columns (down) of the chunk that exist
};

__device__ __forceinline__ ExpertRows gate_up_rows(const bf16_t* gate_up, const bf16_t* shared, int e, int num_experts,
                                                   int hidden, int inter, int shared_width) {
    const int chunks = (shared_width + inter - 1) / inter, c = e - (num_experts - chunks);
    if (c < 0) return {gate_up + (long long)e * 2 * inter * hidden, inter, hidden, inter};
    return {shared + (long long)c * inter * hidden, shared_width, hidden, min(inter, shared_width - c * inter)};
}

__device__ __forceinline__ ExpertRows down_rows(const bf16_t* down, const bf16_t* shared, int e, int num_experts,
                                                int hidden, int inter, int shared_width) {
    const int chunks = (shared_width + inter - 1) / inter, c = e - (num_experts - chunks);
    if (c < 0) return {down + (long long)e * hidden * inter, 0, inter, inter};
    return {shared + (long long)c * inter, 0, shared_width, min(inter, shared_width - c * inter)};
}

// The plan's entry `slot` (its expert e and pairs [lo, hi)), if the plan has that many experts. The
// four words load together, so a launch takes one trip to L2 for them, not the count's and then the
// entry's: every word read is inside the plan (slot < E), and a slot past the count uses none.
__device__ __forceinline__ bool plan_entry(const int* plan, int slot, int num_experts, int& e, int& lo, int& hi) {
    const int n = load_in_order(plan);  // (plain loads: ptxas moved the entry's below the count's branch)
    e = load_in_order(plan + 1 + slot);
    lo = load_in_order(plan + 1 + num_experts + slot);
    hi = load_in_order(plan + 2 + num_experts + slot);
    return slot < n;
}

// act (rows * top_k, inter) = silu(gate_e · x) * (up_e · x) for each pair's expert e. gate_up (E -
// chunks, 2 * inter, hidden); shared_gate_up (2 * shared_width, hidden) or null (shared_width 0);
// hidden % 8 == 0. grid (ceil(inter / 16), min(E, rows * top_k)), block MOE_TC_THREADS.
template <int DEPTH>
__device__ void gate_up_tiles(const bf16_t* x, const bf16_t* gate_up, const bf16_t* shared_gate_up, const int* plan,
                              bf16_t* act, int hidden, int inter, int shared_width, int num_experts, int top_k) {
    __shared__ float red[(MOE_TC_WARPS - 1) * 2 * MOE_TC_NT * 4 * 32];
    TL_BEGIN(1);
    pdl_wait();
    pdl_launch_dependents();
    TL_MARK(1);
    const int slot = blockIdx.y;
    int e, lo, hi;
    if (!plan_entry(plan, slot, num_experts, e, lo, hi)) {
        TL_MARK(5);
        return;
    }
    TL_MARK(2);
    const int j0 = blockIdx.x * MOE_TC_ROWS;
    const ExpertRows er = gate_up_rows(gate_up, shared_gate_up, e, num_experts, hidden, inter, shared_width);
    TcWork<2> wk{er.w, x, plan + 2 + 2 * num_experts, {j0, er.up + j0}, er.valid - j0, j0, inter, hidden, hidden,
                 hidden, top_k, lo, hi, true};
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    for (int base = lo; base < hi; base += MOE_TC_PAIRS) {
        float acc[2][MOE_TC_NT][4] = {};
        wk.pass<DEPTH>(base, acc);
        tc_reduce<2>(acc, red);
        if ((threadIdx.x >> 5) != 0) continue;
#pragma unroll
        for (int nt = 0; nt < MOE_TC_NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = j0 + g + (i >= 2 ? 8 : 0), p = base + nt * 8 + 2 * c + (i & 1);
                if (j >= inter || p >= hi) continue;
                const float gv = round_bf16(acc[0][nt][i]), uv = round_bf16(acc[1][nt][i]);
                act[(long long)wk.pairs[p] * inter + j] = f32_to_bf16(round_bf16(gv / (1.0f + expf(-gv))) * uv);
            }
    }
    TL_MARK(5);
}

extern "C" __global__ void __launch_bounds__(MOE_TC_THREADS)
    moe_gate_up_bf16(const bf16_t* x, const bf16_t* gate_up, const bf16_t* shared_gate_up, const int* plan,
                     bf16_t* act, int hidden, int inter, int shared_width, int num_experts, int top_k) {
    gate_up_tiles<1>(x, gate_up, shared_gate_up, plan, act, hidden, inter, shared_width, num_experts, top_k);
}

// moe_gate_up_bf16 for batch 1, its act bit for bit: a warp keeps MOE_GATE_UP_ONE_DEPTH weight
// blocks in flight (TcWork::pass). Its 168 registers hold 3 CTAs an SM where moe_gate_up_bf16's
// 80 hold 6, so it is launched only where its grid fits one wave of 3 (table.py's
// MOE_GATE_UP_ONE_PER_SM).
extern "C" __global__ void __launch_bounds__(MOE_TC_THREADS)
    moe_gate_up_one_bf16(const bf16_t* x, const bf16_t* gate_up, const bf16_t* shared_gate_up, const int* plan,
                         bf16_t* act, int hidden, int inter, int shared_width, int num_experts, int top_k) {
    gate_up_tiles<MOE_GATE_UP_ONE_DEPTH>(x, gate_up, shared_gate_up, plan, act, hidden, inter, shared_width,
                                         num_experts, top_k);
}

// Batch 1 (one row, so each chosen expert has one pair): moe_down_bf16's out for a column tile in
// one CTA, with no y in global memory and no counter. Warps 4p .. 4p + 3 take the plan's expert p
// (MOE_DOWN_ONE_WARPS / 4 experts a round) and split its K blocks as moe_down_bf16's CTA does, their
// sums added in warp order; y = bf16(bf16(that) * bf16(weight)) per slot goes to shared memory, and
// the tile's out = bf16(the slots' y summed in slot order) [then bf16(residual + that)]: the values
// moe_down_bf16 gives. Arguments as moe_down_bf16's (top_k: the row's slots); grid ceil(hidden /
// 16), block MOE_DOWN_ONE_WARPS * 32; top_k <= MOE_DOWN_ONE_SLOTS. The plan is a one-row plan
// (route_plan's), in slot order: entry p is slot p, its one pair p, so neither offsets nor pairs
// are read.
#define MOE_DOWN_ONE_WARPS 32
#define MOE_DOWN_ONE_SLOTS 32
#ifndef MOE_DOWN_ONE_EARLY
#define MOE_DOWN_ONE_EARLY 1  // before the PDL wait: round 0's first weight blocks, the slots' weights and
                              // the residual (0: all after it)
#endif
extern "C" __global__ void __launch_bounds__(MOE_DOWN_ONE_WARPS * 32, 1)
    moe_down_one_bf16(const bf16_t* act, const bf16_t* down, const bf16_t* shared_down, const int* plan,
                      const float* weights, const bf16_t* residual, bf16_t* out, int hidden, int inter,
                      int shared_width, int num_experts, int top_k) {
    __shared__ float part[MOE_DOWN_ONE_WARPS][MOE_TC_NT * 4][32];
    __shared__ float ys[MOE_DOWN_ONE_SLOTS][MOE_TC_ROWS];
    __shared__ float slot_weight[MOE_DOWN_ONE_SLOTS];  // bf16(weights[s])
    __shared__ bf16_t residual_tile[MOE_TC_ROWS];
    TL_BEGIN(3);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int j0 = blockIdx.x * MOE_TC_ROWS, col = j0 + threadIdx.x;
    // The warp's work item of a round: the plan's expert p = item / MOE_TC_WARPS (its K part: item
    // % MOE_TC_WARPS), its pair p.
    auto work = [&](int item) {
        const int p = item / MOE_TC_WARPS, e = __ldcg(plan + 1 + p);
        const ExpertRows er = down_rows(down, shared_down, e, num_experts, hidden, inter, shared_width);
        return TcWork<1, true>{er.w, act, nullptr, {j0}, hidden - j0, j0, hidden, inter, er.ld, er.valid, top_k, p,
                               p + 1, false};
    };
    // What the router and the launches before it wrote (the slots' weights, the residual): with
    // MOE_DOWN_ONE_EARLY loaded before the wait and stored to shared memory after it, so neither is
    // a trip to L2 after the weights' stream. (The plan is two launches old: moe_gate_up's CTAs let
    // this launch in only after their own wait on the router. The host makes the residual ready
    // before moe_gate_up launches.)
    const bool has_weight = threadIdx.x < top_k;
    const bool has_residual = residual != nullptr && threadIdx.x < MOE_TC_ROWS && col < hidden;
    float w_early = 0.0f;
    bf16_t r_early = 0;
    auto load_inputs = [&] {
        if (has_weight) w_early = __ldcg(weights + threadIdx.x);
        if (has_residual) r_early = __ldcg(residual + col);
    };
    Block16 first[1][2];
#if MOE_DOWN_ONE_EARLY
    const int n = __ldcg(plan);
    if (warp < n * MOE_TC_WARPS) work(warp).load_a(first, warp % MOE_TC_WARPS);
    load_inputs();
    pdl_wait();
    pdl_launch_dependents();
#else
    pdl_wait();
    pdl_launch_dependents();
    const int n = __ldcg(plan);
    load_inputs();
#endif
    if (has_weight) slot_weight[threadIdx.x] = round_bf16(w_early);
    if (has_residual) residual_tile[threadIdx.x] = r_early;
    TL_MARK(1);
    for (int round = 0; round < n * MOE_TC_WARPS; round += MOE_DOWN_ONE_WARPS) {
        const int item = round + warp, p = item / MOE_TC_WARPS, kw = item % MOE_TC_WARPS;
        float acc[1][MOE_TC_NT][4] = {};
        if (p < n) work(item).pass<1>(p, acc, kw, first, MOE_DOWN_ONE_EARLY && round == 0);
#pragma unroll
        for (int nt = 0; nt < MOE_TC_NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[warp][nt * 4 + i][lane] = acc[0][nt][i];
        __syncthreads();  // (the first one also orders the slots' weights and the residual tile)
        if (p < n && kw == 0 && c == 0) {  // lanes 4g: slot p's rows g (i = 0) and g + 8 (i = 2)
#pragma unroll
            for (int i = 0; i < 4; i += 2) {
                float v = acc[0][0][i];
                for (int w = 1; w < MOE_TC_WARPS; ++w) v += part[warp + w][i][lane];
                ys[p][g + (i >= 2 ? 8 : 0)] = round_bf16(round_bf16(v) * slot_weight[p]);
            }
        }
        __syncthreads();
    }
    TL_MARK(2);
    if (threadIdx.x < MOE_TC_ROWS && col < hidden) {
        float s = 0.0f;
        for (int q = 0; q < top_k; ++q) s += ys[q][threadIdx.x];
        s = round_bf16(s);
        if (residual != nullptr) s = bf16_to_f32(residual_tile[threadIdx.x]) + s;
        out[col] = f32_to_bf16(s);
    }
    TL_MARK(5);
}

// y (rows * top_k, hidden) fp32 = bf16(bf16(down_e · act) * bf16(weight)) for each pair; then the
// last CTA of each blockIdx.x to finish (counters: zeroed words, one per blockIdx.x, left zero)
// writes out (rows, hidden) = bf16(sum over the row's slots of y, in slot order) [then
// bf16(residual + that)] for its 16 columns. out may alias residual. down (E - chunks, hidden,
// inter), shared_down (hidden, shared_width) or null; inter % 8 == 0, shared_width % 8 == 0. grid
// (ceil(hidden / 16), min(E, rows * top_k)), block MOE_TC_THREADS.
extern "C" __global__ void __launch_bounds__(MOE_TC_THREADS)
    moe_down_bf16(const bf16_t* act, const bf16_t* down, const bf16_t* shared_down, const int* plan,
                  const float* weights, float* y, const bf16_t* residual, bf16_t* out, unsigned* counters, int rows,
                  int hidden, int inter, int shared_width, int num_experts, int top_k) {
    __shared__ float red[(MOE_TC_WARPS - 1) * MOE_TC_NT * 4 * 32];
    __shared__ bool last;
    TL_BEGIN(2);
    pdl_wait();
    pdl_launch_dependents();
    TL_MARK(1);
    const int slot = blockIdx.y;
    int e, lo, hi;
    if (!plan_entry(plan, slot, num_experts, e, lo, hi)) {
        TL_MARK(5);
        return;
    }
    TL_MARK(2);
    const int j0 = blockIdx.x * MOE_TC_ROWS;
    const ExpertRows er = down_rows(down, shared_down, e, num_experts, hidden, inter, shared_width);
    TcWork<1> wk{er.w, act, plan + 2 + 2 * num_experts, {j0}, hidden - j0, j0, hidden, inter, er.ld, er.valid,
                 top_k, lo, hi, false};
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    for (int base = lo; base < hi; base += MOE_TC_PAIRS) {
        float acc[1][MOE_TC_NT][4] = {};
        wk.pass<1>(base, acc);
        tc_reduce<1>(acc, red);
        if ((threadIdx.x >> 5) != 0) continue;
#pragma unroll
        for (int nt = 0; nt < MOE_TC_NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = j0 + g + (i >= 2 ? 8 : 0), p = base + nt * 8 + 2 * c + (i & 1);
                if (j >= hidden || p >= hi) continue;
                const int q = wk.pairs[p];
                y[(long long)q * hidden + j] = round_bf16(round_bf16(acc[0][nt][i]) * round_bf16(weights[q]));
            }
    }
    __syncthreads();  // this CTA's y is written
    TL_MARK(3);
    if (threadIdx.x == 0) {
        last = last_arrival(counters + blockIdx.x, (unsigned)plan[0]);
    }
    __syncthreads();
    TL_MARK(4);
    if (!last) {
        TL_MARK(5);
        return;
    }
    for (int i = threadIdx.x; i < rows * MOE_TC_ROWS; i += blockDim.x) {
        const int r = i / MOE_TC_ROWS, col = j0 + i % MOE_TC_ROWS;
        if (col >= hidden) continue;
        float s = 0.0f;
        for (int q = 0; q < top_k; ++q) s += __ldcg(y + ((long long)r * top_k + q) * hidden + col);
        s = round_bf16(s);
        if (residual != nullptr) s = bf16_to_f32(residual[(long long)r * hidden + col]) + s;
        out[(long long)r * hidden + col] = f32_to_bf16(s);
    }
    TL_MARK(5);
}
