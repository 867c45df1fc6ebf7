// The split combine inside a tensor-core decode launch (paged_decode_tc.cu's kernels).
#pragma once
#include "decode_tc.cuh"
#include "reduce.cuh"
#include "wht.cuh"

// With a split context the last split of a (sequence, KV head, chunk) to finish (a counter each,
// left zero) reduces the partials exactly as paged_decode_combine<suffix> does (and, with a
// rotated V side's signs, rotates each head back as it does).
struct SplitCombine {
    const float *part_o, *part_ml;
    bf16_t* out;
    unsigned* counters;
    const float* v_signs;  // (2, D) of a rotated V side: the output rotated back (R^T); else null
    int num_splits;
};

#define TC_MAX_SPLITS 64  // the most splits a launch combines (the host's TC_MAX_SPLITS): two a lane

struct CombineShared {
    float weight[TC_ROWS][TC_MAX_SPLITS];  // the split weights and totals
    float total[TC_ROWS];
    int is_last;
};

// The load of V floats: float4 or float.
template <int V>
struct FloatVec {
    typedef float4 type;
};
template <>
struct FloatVec<1> {
    typedef float type;
};

// combine_rows' weighted sums: V consecutive dims of a head a thread (V = 1 or 4), to out, or as
// the bf16 values' floats to stage (rows x D) when the heads are rotated back.
template <int D, int V>
__device__ void combine_sums(const SplitCombine& c, const CombineShared& sh, long long head0, int rows, int active,
                             float* stage) {
    typedef typename FloatVec<V>::type Vec;
    constexpr int Q = D / V;
    for (int idx = threadIdx.x; idx < rows * Q; idx += TC_THREADS) {
        const int r = idx / Q, q = idx % Q;
        const long long head = head0 + r;
        const Vec* po = reinterpret_cast<const Vec*>(c.part_o + head * c.num_splits * D) + q;
        float val[V] = {};
        for (int s0 = 0; s0 < active; s0 += 16) {
            Vec p[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                if (s0 + j < active) p[j] = __ldcg(po + (s0 + j) * Q);
            }
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                if (s0 + j < active) {
                    const float w = sh.weight[r][s0 + j];
                    const float* pv = reinterpret_cast<const float*>(&p[j]);
#pragma unroll
                    for (int v = 0; v < V; ++v) val[v] += pv[v] * w;
                }
            }
        }
        const float t = sh.total[r];
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const bf16_t o = f32_to_bf16(t > 0.0f ? val[v] / t : 0.0f);
            if (stage == nullptr) c.out[head * D + V * q + v] = o;
            else stage[r * D + V * q + v] = bf16_to_f32(o);
        }
    }
}

// The last split's CTA of (sequence, KV head, chunk): out = paged_decode_combine's reduction of
// the `active` partials of its `rows` heads from head0 on (its warp 0's sums, per head). stage:
// rows x D floats of shared scratch, for a rotated V side.
template <int D>
__device__ void combine_rows(const SplitCombine& c, CombineShared& sh, long long head0, int rows, int active,
                             float* stage) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // A warp's heads (max, sum) pairs are loaded together, one 8-byte load each: one trip to L2.
    // Lane l holds splits l and l + 32 (up to TC_MAX_SPLITS); with 32 or fewer the second adds
    // nothing to a lane's sum, so the sums are those of one split a lane.
    constexpr int PER_WARP = (TC_ROWS + TC_WARPS - 1) / TC_WARPS, PER_LANE = TC_MAX_SPLITS / 32;
    float2 ml[PER_WARP][PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
        const int r = warp + i * TC_WARPS;
#pragma unroll
        for (int h = 0; h < PER_LANE; ++h) {
            const int s = lane + 32 * h;
            ml[i][h] = r < rows && s < active
                           ? __ldcg(reinterpret_cast<const float2*>(c.part_ml + ((head0 + r) * c.num_splits + s) * 2))
                           : make_float2(METRALE_NEG_INF, 0.0f);
        }
    }
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
        const int r = warp + i * TC_WARPS;
        if (r >= rows) break;
        float big = ml[i][0].x;
#pragma unroll
        for (int h = 1; h < PER_LANE; ++h) big = fmaxf(big, ml[i][h].x);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
        float mine = 0.0f;
#pragma unroll
        for (int h = 0; h < PER_LANE; ++h) {
            const int s = lane + 32 * h;
            const float w = (s < active && big != METRALE_NEG_INF) ? exp2f(ml[i][h].x - big) : 0.0f;
            if (s < active) mine += ml[i][h].y * w;
            sh.weight[r][s] = w;
        }
        const float l = warp_sum(mine);
        if (lane == 0) sh.total[r] = l;
    }
    __syncthreads();
    // V consecutive dims a thread (4 when that still gives every thread work, else 1), the splits'
    // loads of a pass (up to 16) all issued before the sums: a few L2 round trips per CTA, not one
    // per split and dim. Each dim's sum runs over the splits in order, as paged_decode_combine's.
    float* to = c.v_signs == nullptr ? nullptr : stage;
    if (rows * D / 4 >= TC_THREADS) combine_sums<D, 4>(c, sh, head0, rows, active, to);
    else combine_sums<D, 1>(c, sh, head0, rows, active, to);
    if (to == nullptr) return;
    __syncthreads();
    for (int r = warp; r < rows; r += TC_WARPS) wht_rotate<D>(stage + r * D, c.v_signs + D, c.v_signs);  // R^T
    __syncthreads();
    for (int idx = threadIdx.x; idx < rows * D; idx += TC_THREADS) c.out[head0 * D + idx] = f32_to_bf16(stage[idx]);
}

// Whether this CTA is the last of its item's `active` splits to finish (its partials written).
__device__ bool last_split(const SplitCombine& c, CombineShared& sh, int item, int active) {
    __syncthreads();  // every thread's partials are written
    if (threadIdx.x == 0) {
        unsigned* counter = c.counters + item;
        const bool last = atomic_add_acq_rel(counter, 1u) == (unsigned)active - 1;
        if (last) atomicExch(counter, 0u);  // zero again for the next launch
        sh.is_last = last;
    }
    __syncthreads();
    return sh.is_last;
}
