// moe.cu's kernels as a host library, each over the grid CudaOps launches, so the tests can hold
// the routing, the plan, the expert CTAs and the weighted sums to the torch reference on a CPU:
//   g++ -std=c++20 -O1 -ffp-contract=off -fno-gnu-unique -shared -fPIC -I../include moe_host.cpp -o moe.so
#include "emulate.h"
#include "../moe.cu"

extern "C" void host_moe_route(const bf16_t* logits, int* ids, float* weights, int* plan, long long* experts_read,
                               int rows, int num_experts, int top_k, int shared, int normalize, int threads) {
    run_grid(1, 1, threads, [&] {
        moe_route_bf16(logits, ids, weights, plan, experts_read, rows, num_experts, top_k, shared, normalize);
    });
}

// Batch 1's norm, router and routing: a CTA of GEMV_THREADS per GEMV_WARPS router rows (E, one
// more with shared slots), as CudaOps; logits: LOGIT_PENDING words (the CTAs run in order, so the
// last, which routes, finds every logit stored). With `cluster` the grid runs as one cluster
// (CudaOps's launch of up to MOE_ROUTER_CLUSTER CTAs): CTA 0 routes from the logits it gathers
// from the others' shared memory.
extern "C" void host_moe_router(const bf16_t* router, const bf16_t* h, const bf16_t* gamma, bf16_t* x_out,
                                bf16_t* logits, int* ids, float* weights, int* plan, long long* experts_read,
                                int num_experts, int hidden, int top_k, int shared, int normalize, float eps,
                                int cluster) {
    const unsigned ctas = (num_experts + (shared > 0) + GEMV_WARPS - 1) / GEMV_WARPS;
    auto cta = [&] {
        moe_router_bf16(router, h, gamma, x_out, logits, ids, weights, plan, experts_read, num_experts, hidden,
                        top_k, shared, normalize, eps);
    };
    if (!cluster) {
        run_grid(ctas, 1, GEMV_THREADS, cta);
        return;
    }
    std::vector<EmulatedIndex> blocks;
    for (unsigned x = 0; x < ctas; ++x) blocks.push_back({x, 0, 0});
    gridDim = {ctas, 1, 1};
    run_cluster(blocks, GEMV_THREADS, cta);
    gridDim = {1, 1, 1};
}

// The prefill chunk's routing: a warp per row over ceil(rows / (threads / 32)) CTAs, as CudaOps.
extern "C" void host_moe_route_rows(const bf16_t* logits, int* ids, float* weights, unsigned* counts, int rows,
                                    int num_experts, int top_k, int shared, int normalize, int threads) {
    const int per_cta = threads / 32;
    run_grid((rows + per_cta - 1) / per_cta, 1, threads, [&] {
        moe_route_rows_bf16(logits, ids, weights, counts, rows, num_experts, top_k, shared, normalize);
    });
}

// The prefill chunk's weighted sum: a CTA per row.
extern "C" void host_moe_combine(const bf16_t* ys, const int* where, const float* weights, const bf16_t* residual,
                                 bf16_t* out, int rows, int hidden, int top_k, int threads) {
    run_grid(rows, 1, threads, [&] { moe_combine_bf16(ys, where, weights, residual, out, hidden, top_k); });
}

// moe_gate_up_bf16 (moe_gate_up_one_bf16 when `one`) over a grid of `chosen` expert slots and 16
// weight rows a CTA, as CudaOps.
static void gate_up_grid(const bf16_t* x, const bf16_t* gate_up, const bf16_t* shared_gate_up, const int* plan,
                         bf16_t* act, unsigned chosen, int hidden, int inter, int shared_width, int num_experts,
                         int top_k, bool one = false) {
    const auto kernel = one ? moe_gate_up_one_bf16 : moe_gate_up_bf16;
    run_grid((inter + MOE_TC_ROWS - 1) / MOE_TC_ROWS, chosen, MOE_TC_THREADS, [&] {
        kernel(x, gate_up, shared_gate_up, plan, act, hidden, inter, shared_width, num_experts, top_k);
    });
}

// The expert kernels over a grid of `chosen` = min(E, rows * top_k) expert slots and 16 weight rows
// a CTA, as CudaOps; counters: one zeroed word per column tile of moe_down_bf16. E counts any
// shared chunks, whose weights are shared_gate_up / shared_down (shared_width 0: none).
extern "C" void host_moe_experts(const bf16_t* x, const bf16_t* gate_up, const bf16_t* down,
                                 const bf16_t* shared_gate_up, const bf16_t* shared_down, const int* plan,
                                 const float* weights, const bf16_t* residual, bf16_t* act, float* y, bf16_t* out,
                                 unsigned* counters, int rows, int hidden, int inter, int shared_width, int num_experts,
                                 int top_k) {
    const unsigned chosen = (unsigned)min(num_experts, rows * top_k);
    gate_up_grid(x, gate_up, shared_gate_up, plan, act, chosen, hidden, inter, shared_width, num_experts, top_k);
    run_grid((hidden + MOE_TC_ROWS - 1) / MOE_TC_ROWS, chosen, MOE_TC_THREADS, [&] {
        moe_down_bf16(act, down, shared_down, plan, weights, y, residual, out, counters, rows, hidden, inter,
                      shared_width, num_experts, top_k);
    });
}

// Batch 1's experts as CudaOps launches them: moe_gate_up_one_bf16, then moe_down_one_bf16 (a CTA of
// MOE_DOWN_ONE_WARPS warps per column tile) in place of moe_down_bf16.
extern "C" void host_moe_experts_one(const bf16_t* x, const bf16_t* gate_up, const bf16_t* down,
                                     const bf16_t* shared_gate_up, const bf16_t* shared_down, const int* plan,
                                     const float* weights, const bf16_t* residual, bf16_t* act, bf16_t* out, int hidden,
                                     int inter, int shared_width, int num_experts, int top_k) {
    gate_up_grid(x, gate_up, shared_gate_up, plan, act, (unsigned)min(num_experts, top_k), hidden, inter,
                 shared_width, num_experts, top_k, true);
    run_grid((hidden + MOE_TC_ROWS - 1) / MOE_TC_ROWS, 1, MOE_DOWN_ONE_WARPS * 32, [&] {
        moe_down_one_bf16(act, down, shared_down, plan, weights, residual, out, hidden, inter, shared_width,
                          num_experts, top_k);
    });
}
