// The hand-off between two consecutive launches of a batch-1 decode step (tools/launch_handoff.py).
//
// A chain of `relay` launches: each CTA reads the whole vector the launch before wrote (n bf16),
// sums its squares with a block reduction (as a GEMV's norm does), streams `stream_bytes` /
// gridDim.x bytes of weights of its own (16-byte loads, 8 a lane in flight, as gemv.cu), and
// writes its share of the next vector. How a launch learns that its input is ready (`mode`):
//   0  plain stream order (no programmatic launch);
//   1  programmatic launch, griddepcontrol.wait (pdl.cuh), as every decode kernel does today;
//   2  programmatic launch, no griddepcontrol.wait: one thread a CTA polls the launch before's
//      counter (ld.acquire) until all its CTAs have added theirs (red.release after their
//      stores), then the next launch is let in. The chain's first launch waits on nothing.
// With `early` the launch's first 8 weight chunks a lane are loaded before it waits (gemv.cu).
#include "gemv.cuh"  // load_weights: the decode GEMVs' streamed 16-byte load

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void add_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

extern "C" __global__ void __launch_bounds__(256, 2)
    relay(const bf16_t* in, bf16_t* out, const bf16_t* weights, long long stream_chunks, unsigned* wait_on,
          unsigned* signal, int producers, int n, int mode, int early, float* sink) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long per_cta = stream_chunks / gridDim.x;
    const bf16_t* w = weights + blockIdx.x * per_cta * 8;
    Chunk first[8];
    if (early) {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const long long i = (long long)(warp * 8 + u) * 32 + lane;
            if (i < per_cta) first[u] = load_weights(w + i * 8);
        }
    }
    if (mode == 1) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    } else if (mode == 2) {
        if (wait_on != nullptr && threadIdx.x == 0) {
            while (load_acquire(wait_on) < (unsigned)producers) {
            }
        }
        __syncthreads();
        asm volatile("griddepcontrol.launch_dependents;");
    }
    float ss = 0.0f;
    for (int i = threadIdx.x * 8; i < n; i += blockDim.x * 8) {
        const uint4 c = __ldcg(reinterpret_cast<const uint4*>(in + i));  // L2: written by another launch
        const unsigned u[4] = {c.x, c.y, c.z, c.w};
        for (int j = 0; j < 4; ++j) {
            const float lo = __uint_as_float(u[j] << 16), hi = __uint_as_float(u[j] & 0xffff0000u);
            ss += lo * lo + hi * hi;
        }
    }
    const float total = block_sum(ss);
    unsigned acc = 0;
    if (early) {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const long long i = (long long)(warp * 8 + u) * 32 + lane;
            if (i < per_cta) acc ^= first[u].w[0] ^ first[u].w[1] ^ first[u].w[2] ^ first[u].w[3];
        }
    }
    for (long long base = (early ? 64 * 32 : 0) + (long long)warp * 8 * 32; base < per_cta; base += 64 * 32) {
        Chunk c[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const long long i = base + u * 32 + lane;
            if (i < per_cta) c[u] = load_weights(w + i * 8);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const long long i = base + u * 32 + lane;
            if (i < per_cta) acc ^= c[u].w[0] ^ c[u].w[1] ^ c[u].w[2] ^ c[u].w[3];
        }
    }
    if (acc == 0x12345678u) sink[0] = 1.0f;  // keeps the stream
    const int per = n / gridDim.x;
    for (int i = threadIdx.x; i < per; i += blockDim.x) {
        const int j = blockIdx.x * per + i;
        out[j] = f32_to_bf16(bf16_to_f32(__ldcg(in + j)) * (1.0f + 1e-9f * total));
    }
    if (mode == 2) {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            add_release(signal, 1u);
        }
    }
}
