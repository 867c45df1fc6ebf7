// Cross-SM hand-off latency, the floor under every design of a batch-1 decode step that splits a
// layer's GEMVs over all SMs (see tools/handoff_latency.py).
//
// One CTA per SM. A hop: every CTA waits for the whole vector of the previous hop, sums it (a
// block reduction, as a GEMV's norm does) and writes its PER values of the next. Protocols
// (HOP_PROTO):
//   0  flagged words as the whole-stack kernel's (64 bits: flag << 32 | one bf16), every thread
//      polling its words, HOP_POLL_NS back-off;
//   1  flagged words carrying two bf16 each: half the words to poll;
//   2  plain bf16 and one monotonic counter: a red.release by each CTA, one thread per CTA
//      polling with ld.acquire, then the vector read from L2.
// HOP_STREAM=1 adds a producer warp per CTA streaming a buffer larger than L2 through four
// shared-memory stages with bulk copies of `chunk` bytes, as the whole-stack kernel's weight
// stream does; the stream runs until the hops end, and its rate is reported.
//
// hop_cluster: the same hop inside clusters of 8 CTAs, through distributed shared memory and a
// cluster barrier (no stream).
#ifndef HOP_PROTO
#define HOP_PROTO 0
#endif
#ifndef HOP_POLL_NS
#define HOP_POLL_NS 0
#endif
#ifndef HOP_STREAM
#define HOP_STREAM 0
#endif
#define HOP_THREADS 256
#define HOP_PER 8
#define HOP_STAGES 4
#define HOP_STAGE_BYTES 32768

#include "bulk_copy.cuh"  // kernels_cu/include
#include "numeric.cuh"

typedef unsigned long long Word;

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(HOP_THREADS) : "memory"); }

__device__ float block_sum(float v, float* red) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    consumers_sync();
    float s = 0.0f;
    for (int w = 0; w < HOP_THREADS / 32; ++w) s += red[w];
    consumers_sync();
    return s;
}

// The producer lane: chunks of `stream` into the stages until *done, then drains. Returns the
// number of chunks copied.
__device__ long long stream_until(const volatile int* done, const char* stream, long long stream_bytes, int chunk,
                                  unsigned char* ring, unsigned long long* bars) {
    const long long chunks = stream_bytes / chunk;
    long long j = 0;
    for (; !*done; ++j) {
        const int s = (int)(j % HOP_STAGES);
        if (j >= HOP_STAGES) mbar_wait(bars + s, (unsigned)((j / HOP_STAGES - 1) & 1));
        const long long c = (j * gridDim.x + blockIdx.x) % chunks;
        mbar_expect(bars + s, chunk);
        bulk_copy(ring + s * HOP_STAGE_BYTES, stream + c * chunk, chunk, bars + s);
    }
    for (long long k = j > HOP_STAGES ? j - HOP_STAGES : 0; k < j; ++k) {
        mbar_wait(bars + k % HOP_STAGES, (unsigned)((k / HOP_STAGES) & 1));
    }
    return j;
}

// words: 2 x n flagged words, buffer 0 carrying flag `base` (protocols 0, 1); plain: 2 x n bf16,
// counter: one zeroed word (protocol 2); n = PER x the grid. out[0]: the sums (kept live);
// out[1]: the stream's chunks copied by CTA 0. grid = the SM count, block = HOP_THREADS + 32,
// dynamic shared memory HOP_STAGES x HOP_STAGE_BYTES.
extern "C" __global__ void __launch_bounds__(HOP_THREADS + 32, 1)
    hop(Word* words, bf16_t* plain, unsigned* counter, int n, int iters, const char* stream,
        long long stream_bytes, int chunk, unsigned base, float* out) {
    __shared__ float red[HOP_THREADS / 32];
    __shared__ volatile int done;
    __shared__ __align__(8) unsigned long long bars[HOP_STAGES];
    extern __shared__ __align__(128) unsigned char ring[];
    if (threadIdx.x == 0) done = 0;
    if (HOP_STREAM && threadIdx.x == HOP_THREADS) {
        for (int s = 0; s < HOP_STAGES; ++s) mbar_init(bars + s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x >= HOP_THREADS) {
        if (HOP_STREAM && threadIdx.x == HOP_THREADS) {
            const long long copied = stream_until(&done, stream, stream_bytes, chunk, ring, bars);
            if (blockIdx.x == 0) out[1] = (float)copied;
        }
        return;
    }
    const int t0 = blockIdx.x * HOP_PER;
    float acc = 0.0f;
    for (int it = 0; it < iters; ++it) {
        const unsigned flag = base + it;
        const int buf = it & 1, next = buf ^ 1;
        float s = 0.0f;
#if HOP_PROTO == 0 || HOP_PROTO == 1
        const int nwords = HOP_PROTO == 0 ? n : n / 2;
        const Word* w = words + (long long)buf * n;
        for (int i = threadIdx.x; i < nwords; i += HOP_THREADS) {
            Word x;
            while (true) {
                asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(x) : "l"(w + i) : "memory");
                if ((unsigned)(x >> 32) == flag) break;
                if (HOP_POLL_NS) __nanosleep(HOP_POLL_NS);
            }
            s += bf16_to_f32((bf16_t)x) + (HOP_PROTO == 1 ? bf16_to_f32((bf16_t)(x >> 16)) : 0.0f);
        }
#else
        (void)flag;
        if (threadIdx.x == 0) {
            const unsigned want = gridDim.x * (unsigned)it;  // every CTA's releases of hops 0 .. it - 1
            unsigned c;
            while (true) {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(counter) : "memory");
                if ((int)(c - want) >= 0) break;
                if (HOP_POLL_NS) __nanosleep(HOP_POLL_NS);
            }
        }
        consumers_sync();
        const bf16_t* p = plain + (long long)buf * n;
        for (int i = threadIdx.x; i < n; i += HOP_THREADS) {
            unsigned short x;
            asm volatile("ld.relaxed.gpu.global.u16 %0, [%1];" : "=h"(x) : "l"(p + i) : "memory");
            s += bf16_to_f32(x);
        }
#endif
        s = block_sum(s, red);
        acc += s;
        const float v = s * 1e-3f + threadIdx.x, f = v - floorf(v);
#if HOP_PROTO == 0
        if (threadIdx.x < HOP_PER) {
            const Word x = (Word)(flag + 1) << 32 | f32_to_bf16(f);
            asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(words + (long long)next * n + t0 + threadIdx.x), "l"(x)
                         : "memory");
        }
#elif HOP_PROTO == 1
        if (threadIdx.x < HOP_PER / 2) {
            const Word x = (Word)(flag + 1) << 32 | f32_to_bf16(f) | (unsigned)f32_to_bf16(1.0f - f) << 16;
            asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(words + (long long)next * n + t0 / 2 + threadIdx.x),
                         "l"(x)
                         : "memory");
        }
#else
        if (threadIdx.x < 32) {
            if (threadIdx.x < HOP_PER) plain[(long long)next * n + t0 + threadIdx.x] = f32_to_bf16(f);
            __syncwarp();
            if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        }
#endif
    }
    if (threadIdx.x == 0) atomicAdd(out, acc);
    consumers_sync();
    if (threadIdx.x == 0) done = 1;
}

// Clusters of 8: each CTA writes its 128 values of a 1024-value vector into every peer's shared
// memory, then the cluster barrier (release / acquire) ends the hop. grid: a multiple of 8,
// block HOP_THREADS.
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(HOP_THREADS, 1)
    hop_cluster(int iters, float* out) {
    __shared__ float red[HOP_THREADS / 32];
    __shared__ __align__(16) bf16_t vec[2][1024];
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    for (int i = threadIdx.x; i < 1024; i += HOP_THREADS) vec[0][i] = 0;
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    float acc = 0.0f;
    for (int it = 0; it < iters; ++it) {
        const int buf = it & 1, next = buf ^ 1;
        float s = 0.0f;
        for (int i = threadIdx.x; i < 1024; i += HOP_THREADS) s += bf16_to_f32(vec[buf][i]);
        s = block_sum(s, red);
        acc += s;
        if (threadIdx.x < 128) {  // 16 x 16 bytes to each of the 8 peers
            const int peer = threadIdx.x >> 4, part = threadIdx.x & 15;
            const float v = s * 1e-3f + part;
            const unsigned x = f32_to_bf16(v - floorf(v)), w = x | x << 16;
            unsigned remote;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                         : "=r"(remote)
                         : "r"(smem_addr(&vec[next][rank * 128 + part * 8])), "r"(peer));
            asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(remote), "r"(w) : "memory");
        }
        asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    }
    if (threadIdx.x == 0) atomicAdd(out, acc);
}
