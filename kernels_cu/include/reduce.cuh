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
