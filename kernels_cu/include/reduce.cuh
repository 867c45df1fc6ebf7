// Warp and block reductions (fp32).
#pragma once

// The CTA-wide barrier and warp count of the code below: the whole block by default; a kernel
// whose block holds warps outside that code (decode_stack.cu's producer warp) defines both to
// name a barrier of its other warps before including this header.
#ifndef CTA_SYNC
#define CTA_SYNC() __syncthreads()
#define CTA_WARPS ((int)(blockDim.x >> 5))
#endif

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the CTA's CTA_WARPS warps (at most 32); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    CTA_SYNC();
    if (warp == 0) {
        float w = lane < CTA_WARPS ? partial[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) total = w;
    }
    CTA_SYNC();
    return total;
}

// Counters across the CTAs of a grid (the last CTA to finish a piece of work does what follows it).

// *p += v at GPU scope (WRAP: *p = *p >= v ? 0 : *p + 1), returning the old value, releasing what
// the CTA wrote before its barrier (the release is cumulative over the writes bar.sync ordered
// before it) and acquiring what the adds before it released: one trip to L2, where two fences and
// a relaxed add took three.
template <bool WRAP>
__device__ __forceinline__ unsigned atomic_acq_rel(unsigned* p, unsigned v) {
#if !defined(METRALE_HOST_EMULATION) && defined(__CUDA_ARCH__)
    unsigned old;
    if constexpr (WRAP)
        asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    else
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
#else
    __threadfence();
    const unsigned old = *p;
    *p = WRAP ? (old >= v ? 0u : old + 1u) : old + v;
    __threadfence();
    return old;
#endif
}

__device__ __forceinline__ unsigned atomic_add_acq_rel(unsigned* p, unsigned v) { return atomic_acq_rel<false>(p, v); }

// Whether this is the last of `arrivals` arrivals at a zeroed counter: its increment sets the word
// back to zero for the next launch in the same trip to L2 (no exchange after it).
__device__ __forceinline__ bool last_arrival(unsigned* counter, unsigned arrivals) {
    return atomic_acq_rel<true>(counter, arrivals - 1) == arrivals - 1;
}
