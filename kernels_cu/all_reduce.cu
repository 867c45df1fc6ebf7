// One-shot collectives of tensor-parallel ranks for a decode step's small tensors: the sum of the
// ranks' bf16 parts (the all-reduce after a row-parallel projection) and the LM head's fp32 logits
// gathered side by side. Each rank's process allocates one data buffer and one signal buffer and
// maps every other rank's into its address space (CUDA IPC; on one GPU or over NVLink), so a rank
// reads its peers' parts itself: one launch, no ring, capturable in a CUDA graph (its addresses
// are fixed, its epochs counted on the device).
//
// A launch is AR_BLOCKS CTAs on every rank, CTA b taking the same slice of the tensor on every
// rank and every call:
//   1. thread 0 takes the call's epoch, one more than CTA b's last (a counter in its own signal
//      buffer; every rank runs the same calls, so the ranks' epochs agree);
//   2. the CTA copies its slice of this rank's part into its own data buffer, half epoch % 2;
//   3. thread r (r < ranks) publishes the epoch into rank r's flag for (b, this rank), a release
//      at system scope after the CTA's barrier, and waits for this rank's flag for (b, r) to reach
//      the epoch (acquire);
//   4. the CTA reads its slice of every rank's half through L2 (ld.global.cg: L1 is not kept
//      coherent with other SMs' or other GPUs' writes) and writes the sum, in rank order and in
//      fp32, rounded once to bf16 (what NCCL gives for two ranks), or the parts side by side.
// No closing barrier: a rank writes half h again two calls later, only after passing CTA b's
// barrier of the call between, which its peers reach only once their call that read half h has
// completed (launches on one stream run in order, and these launch plainly). Flags are compared
// by signed difference, since a fast peer may already have published the next epoch. A wait that
// passes 10 s (a peer that died) traps, so the launch fails instead of hanging.
#include "numeric.cuh"

#define AR_BLOCKS 32
#define AR_THREADS 512
#define AR_MAX_RANKS 8
// A signal buffer: flags[AR_BLOCKS][AR_MAX_RANKS] (flag (b, r): the last epoch rank r published to
// this rank for CTA b), then counters[AR_BLOCKS] (this rank's last epoch of CTA b); zeroed at start.
#define AR_COUNTERS (AR_BLOCKS * AR_MAX_RANKS)
#define AR_TIMEOUT_NS 10000000000ull

__device__ __forceinline__ void store_release_sys(unsigned* p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned load_acquire_sys(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");
    return t;
}

// Steps 1 and 3 around the caller's step 2 (`stage`): returns the call's epoch once every rank's
// CTA b has staged its slice.
template <typename Stage>
__device__ unsigned one_shot_barrier(const long long* signals, int rank, int ranks, Stage stage) {
    __shared__ unsigned epoch_shared;
    unsigned* own = reinterpret_cast<unsigned*>(signals[rank]);
    if (threadIdx.x == 0) epoch_shared = atomicAdd(own + AR_COUNTERS + blockIdx.x, 1u) + 1u;
    __syncthreads();
    const unsigned epoch = epoch_shared;
    stage(epoch & 1u);
    __syncthreads();
    if (threadIdx.x < ranks) {
        __threadfence_system();
        unsigned* peer = reinterpret_cast<unsigned*>(signals[threadIdx.x]);
        store_release_sys(peer + blockIdx.x * AR_MAX_RANKS + rank, epoch);
        const unsigned* flag = own + blockIdx.x * AR_MAX_RANKS + threadIdx.x;
        const unsigned long long start = now_ns();
        while ((int)(load_acquire_sys(flag) - epoch) < 0) {
            if (now_ns() - start > AR_TIMEOUT_NS) __trap();
        }
    }
    __syncthreads();
    return epoch;
}

// This CTA's share [lo, hi) of `count` 16-byte vectors.
__device__ __forceinline__ void block_slice(long long count, long long& lo, long long& hi) {
    const long long per = (count + AR_BLOCKS - 1) / AR_BLOCKS;
    lo = min(count, per * blockIdx.x);
    hi = min(count, lo + per);
}

// out = the sum over the ranks of each rank's x (n bf16 elements, n % 8 == 0, n <= capacity, out
// may be x). data / signals: every rank's buffers' addresses, in rank order; a data buffer holds
// two halves of `capacity` elements. grid AR_BLOCKS, block AR_THREADS, launched plainly.
extern "C" __global__ void __launch_bounds__(AR_THREADS)
    one_shot_sum_bf16(const bf16_t* x, bf16_t* out, const long long* data, const long long* signals, int n, int rank,
                      int ranks, int capacity) {
    long long lo, hi;
    block_slice(n / 8, lo, hi);
    const uint4* in = reinterpret_cast<const uint4*>(x);
    const unsigned epoch = one_shot_barrier(signals, rank, ranks, [&](unsigned half) {
        uint4* mine = reinterpret_cast<uint4*>(reinterpret_cast<bf16_t*>(data[rank]) + (long long)half * capacity);
        for (long long v = lo + threadIdx.x; v < hi; v += AR_THREADS) mine[v] = in[v];
    });
    const long long offset = (long long)(epoch & 1u) * capacity;
    for (long long v = lo + threadIdx.x; v < hi; v += AR_THREADS) {
        float sum[8] = {};
        for (int r = 0; r < ranks; ++r) {
            const bf16_t* half = reinterpret_cast<const bf16_t*>(data[r]) + offset;
            const uint4 part = __ldcg(reinterpret_cast<const uint4*>(half) + v);
            const unsigned words[4] = {part.x, part.y, part.z, part.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                sum[2 * i] += bf16_to_f32((bf16_t)(words[i] & 0xffffu));
                sum[2 * i + 1] += bf16_to_f32((bf16_t)(words[i] >> 16));
            }
        }
        unsigned words[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            words[i] = (unsigned)f32_to_bf16(sum[2 * i]) | ((unsigned)f32_to_bf16(sum[2 * i + 1]) << 16);
        reinterpret_cast<uint4*>(out)[v] = make_uint4(words[0], words[1], words[2], words[3]);
    }
}

// out (rows, ranks * cols) = every rank's x (rows, cols) side by side, rank 0's first (fp32; cols %
// 4 == 0, rows * cols <= capacity, in fp32 elements a half). Otherwise as one_shot_sum_bf16.
extern "C" __global__ void __launch_bounds__(AR_THREADS)
    one_shot_gather_f32(const float* x, float* out, const long long* data, const long long* signals, int rows,
                        int cols, int rank, int ranks, int capacity) {
    long long lo, hi;
    block_slice((long long)rows * cols / 4, lo, hi);
    const float4* in = reinterpret_cast<const float4*>(x);
    const unsigned epoch = one_shot_barrier(signals, rank, ranks, [&](unsigned half) {
        float4* mine = reinterpret_cast<float4*>(reinterpret_cast<float*>(data[rank]) + (long long)half * capacity);
        for (long long v = lo + threadIdx.x; v < hi; v += AR_THREADS) mine[v] = in[v];
    });
    const long long offset = (long long)(epoch & 1u) * capacity;
    const int row_vectors = cols / 4;
    for (long long v = lo + threadIdx.x; v < hi; v += AR_THREADS) {
        const long long row = v / row_vectors, col = v % row_vectors;
        for (int r = 0; r < ranks; ++r) {
            const float* half = reinterpret_cast<const float*>(data[r]) + offset;
            const float4 part = __ldcg(reinterpret_cast<const float4*>(half) + v);
            reinterpret_cast<float4*>(out)[(row * ranks + r) * row_vectors + col] = part;
        }
    }
}
