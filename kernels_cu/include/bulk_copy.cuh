// Bulk asynchronous copies (TMA, sm_90) from global into shared memory, counted on transaction
// barriers (mbarrier): gemm_rows.cu's and the whole-stack decode kernel's rings, batch 1's down
// (moe_down_smem.cu) and tools/handoff_latency.cu. In the host emulation (kernels_cu/host) a copy
// is done when it is issued, and a barrier (one phase: parity 0) holds its waiters until its
// expected bytes have arrived.
#pragma once

#ifdef METRALE_HOST_EMULATION
// A barrier's word: bit 32 set once the expect has arrived, the low 32 bits the bytes still to come.
inline int mbar_pending(unsigned long long w) { return (int)(unsigned)w; }
inline void mbar_init(unsigned long long* bar, unsigned) { *bar = 0; }
inline void mbar_init_fence() {}
inline void mbar_expect(unsigned long long* bar, unsigned bytes) {
    *bar = (1ull << 32) | (unsigned)(mbar_pending(*bar) + (int)bytes);
    ++emulated.progress;
}
inline void mbar_wait(unsigned long long* bar, unsigned) {
    while (!(*bar >> 32) || mbar_pending(*bar) != 0) emulated_yield();
}
inline void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    std::memcpy(dst, src, bytes);
    *bar = (*bar & (1ull << 32)) | (unsigned)(mbar_pending(*bar) - (int)bytes);
    ++emulated.progress;
}
#else

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Makes the barriers thread 0 just initialized visible to the bulk copies (then __syncthreads).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred done;\n"
        "wait: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra wait;\n}" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// bytes (a multiple of 16) from global src to shared dst, counted on bar.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}
#endif
