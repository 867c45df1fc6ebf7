// Batch 1's down projection with every weight row it reads requested at once (sm_90: bulk copies
// into shared memory counted on transaction barriers), the values of moe.cu's moe_down_one_bf16
// (and so of moe_down_bf16) bit for bit.
//
// moe_down_one_bf16 streams its column tile's weights through registers: each warp loads one
// 64-element block, multiplies, loads the next, and the slots past its 32 warps' first round (8
// experts) wait for a second round. Here a CTA of 16 hidden columns copies the 16 weight rows of
// every slot's expert (16 x K bf16 each, one bulk copy a row) into shared memory before its PDL
// wait, from the plan, which is two launches old (moe_gate_up's CTAs let this launch in only after
// their own wait on the router). A CTA is let onto an SM once gate/up's CTAs there have left, and
// then asks for all of its weights together, while gate/up still streams on the other SMs. After
// the wait each warp takes (expert p, K part kw) items, kw = moe_down_one_bf16's warp of the expert
// (blocks kw, kw + 4, ..): it waits for expert p's rows, reads its A operands from shared memory and
// the pair's act row (gate/up's output) from global memory, and runs TcWork::pass's MMAs in its
// order. An item's sums for the pair's column (lanes 4g, rows g and g + 8) go to shared memory; the
// parts of an expert are added in part order ((p0 + p1) + p2) + p3, y = bf16(bf16(that) *
// bf16(weight)) per slot, and out = bf16(the slots' y in slot order) [then bf16(residual + that)]:
// moe_down_one_bf16's arithmetic in its order.
//
// Shared memory: a slot's 16 rows at a pitch of K * 2 + 16 bytes (the 16 bytes keep lanes g and g +
// 4 of a load on different banks), top_k slots (host: MOE_DOWN_SMEM_PITCH, moe_down_smem_bytes),
// dynamic; the barriers and sums static. Arguments and grid as moe_down_one_bf16's; block
// MOE_DOWN_SMEM_WARPS * 32; top_k <= MOE_DOWN_ONE_SLOTS.
#include "bulk_copy.cuh"
#include "moe_tc.cuh"
#include "pdl.cuh"
#include "timeline.cuh"

#define MOE_DOWN_ONE_SLOTS 32  // moe_down_one_bf16's: the row's slots it serves
#ifndef MOE_DOWN_SMEM_WARPS
#define MOE_DOWN_SMEM_WARPS 16
#endif
#define MOE_DOWN_SMEM_PAD 16  // bytes after each weight row

#ifdef METRALE_HOST_EMULATION
// The emulation's bulk copies are plain copies, done when issued; its barriers are done at once.
#define MOE_DOWN_SMEM_HOST_BYTES (MOE_DOWN_ONE_SLOTS * MOE_TC_ROWS * (2 * 4096 + MOE_DOWN_SMEM_PAD))
#endif

extern "C" __global__ void __launch_bounds__(MOE_DOWN_SMEM_WARPS * 32, 1)
    moe_down_smem_bf16(const bf16_t* act, const bf16_t* down, const bf16_t* shared_down, const int* plan,
                       const float* weights, const bf16_t* residual, bf16_t* out, int hidden, int inter,
                       int shared_width, int num_experts, int top_k) {
#ifdef METRALE_HOST_EMULATION
    static __align__(128) unsigned char rows[MOE_DOWN_SMEM_HOST_BYTES];
#else
    extern __shared__ __align__(128) unsigned char rows[];
#endif
    __shared__ __align__(8) unsigned long long bars[MOE_DOWN_ONE_SLOTS];
    __shared__ float part[MOE_DOWN_ONE_SLOTS * MOE_TC_WARPS][MOE_TC_ROWS];
    __shared__ float ys[MOE_DOWN_ONE_SLOTS][MOE_TC_ROWS];
    TL_BEGIN(0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int j0 = blockIdx.x * MOE_TC_ROWS, rows_valid = min(MOE_TC_ROWS, hidden - j0);
    const int pitch = 2 * inter + MOE_DOWN_SMEM_PAD;
    const int n = __ldcg(plan);
#ifdef METRALE_HOST_EMULATION
    if ((long long)n * MOE_TC_ROWS * pitch > (long long)sizeof(rows)) std::abort();
#endif
    if (threadIdx.x == 0) {
        for (int p = 0; p < n; ++p) mbar_init(&bars[p], 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (warp == 0) {  // before the wait: every slot's rows, a lane a row
        for (int p = 0; p < n; ++p) {
            const ExpertRows er = down_rows(down, shared_down, __ldcg(plan + 1 + p), num_experts, hidden, inter,
                                            shared_width);
            const unsigned bytes = 2u * er.valid;
            if (lane == 0) mbar_expect(&bars[p], bytes * rows_valid);
            __syncwarp();
            if (lane < rows_valid)
                bulk_copy(rows + (p * MOE_TC_ROWS + lane) * pitch, er.w + (long long)(j0 + lane) * er.ld, bytes,
                          &bars[p]);
        }
    }
    pdl_wait();
    pdl_launch_dependents();
    TL_MARK(1);
    const int* pairs = plan + 2 + 2 * num_experts;
    const int blocks = (inter + 63) / 64;
    for (int item = warp; item < n * MOE_TC_WARPS; item += MOE_DOWN_SMEM_WARPS) {
        const int p = item / MOE_TC_WARPS, kw = item % MOE_TC_WARPS;
        const int e = __ldcg(plan + 1 + p), lo = __ldcg(plan + 1 + num_experts + p);
        const int valid = down_rows(down, shared_down, e, num_experts, hidden, inter, shared_width).valid;
        // the pair's act row: B's lanes g = 0 (pair column 0), the rest zeros (TcWork's one pair)
        const bf16_t* xrow = g == 0 ? act + (long long)pairs[lo] * inter : nullptr;
        const unsigned char* slot = rows + p * MOE_TC_ROWS * pitch;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mbar_wait(&bars[p], 0);
        for (int kb = kw; kb < blocks; kb += MOE_TC_WARPS) {
            const int k0 = kb * 64 + 16 * c;
            Block16 a[2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int k = k0 + 8 * q;
                    a[h].c[q] = g + 8 * h < rows_valid && k < valid
                                    ? *reinterpret_cast<const Chunk*>(slot + (g + 8 * h) * pitch + 2 * k)
                                    : Chunk{{0u, 0u, 0u, 0u}};
                }
            const Block16 b = load_block(xrow, k0, inter, xrow != nullptr, false);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned bw[2] = {block_word(b, 2 * i), block_word(b, 2 * i + 1)};
                const unsigned aw[4] = {block_word(a[0], 2 * i), block_word(a[1], 2 * i), block_word(a[0], 2 * i + 1),
                                        block_word(a[1], 2 * i + 1)};
                mma_bf16_16816(acc, aw, bw);
            }
        }
        if (c == 0) part[item][g] = acc[0], part[item][g + 8] = acc[2];  // the pair's column: rows g, g + 8
    }
    __syncthreads();
    TL_MARK(2);
    for (int t = threadIdx.x; t < n * MOE_TC_ROWS; t += blockDim.x) {  // (slot's expert, row): parts in order
        const int p = t / MOE_TC_ROWS, r = t % MOE_TC_ROWS;
        const int q = pairs[__ldcg(plan + 1 + num_experts + p)];
        float v = part[p * MOE_TC_WARPS][r];
        for (int w = 1; w < MOE_TC_WARPS; ++w) v += part[p * MOE_TC_WARPS + w][r];
        ys[q][r] = round_bf16(round_bf16(v) * round_bf16(weights[q]));
    }
    __syncthreads();
    const int col = j0 + threadIdx.x;
    if (threadIdx.x < MOE_TC_ROWS && col < hidden) {
        float s = 0.0f;
        for (int q = 0; q < top_k; ++q) s += ys[q][threadIdx.x];
        s = round_bf16(s);
        if (residual != nullptr) s = bf16_to_f32(residual[col]) + s;
        out[col] = f32_to_bf16(s);
    }
    TL_MARK(5);
}
