// Programmatic dependent launch (sm_90+): a kernel launched with the programmatic-serialization
// attribute may start while the kernel before it in the stream still runs. Such a kernel calls
// pdl_wait() in every CTA before it touches memory the kernel just before it writes or reads:
// the wait returns once the previous grid has completed and its writes are visible, and a grid
// that waited completes only after its own predecessor did, so the order holds down the whole
// chain. pdl_launch_dependents() lets the next such kernel be scheduled onto SMs this grid's
// finished CTAs free; every kernel calls it after its wait. So when a kernel starts, the kernel
// before it has passed its wait, and every launch before that one has completed: before its own
// wait a kernel may read constants (weights, tables) and what launches two or more back wrote
// (a decode step's inputs, the cache's earlier keys), the latter through L2 (__ldcg), since L1
// is not kept coherent with writes from other kernels. Both are no-ops in a normal launch,
// below sm_90 and in the host emulation, as is pdl_prefetch_l2.
#pragma once

__device__ __forceinline__ void pdl_wait() {
#if !defined(METRALE_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if !defined(METRALE_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Pull bytes (a multiple of 16) at p (16-byte aligned) into L2, without waiting: for data a
// kernel will read after its wait.
__device__ __forceinline__ void pdl_prefetch_l2(const void* p, unsigned bytes) {
#if !defined(METRALE_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
    (void)p, (void)bytes;
#endif
}

// Loads that ptxas keeps where they are written (relaxed .gpu loads, served from L2), for the
// first reads after a wait that should issue together: plain loads, in C or in asm, it may move
// below a branch or next to their first use, each one then a trip to L2 behind the one before.
__device__ __forceinline__ int load_in_order(const int* p) {
#if !defined(METRALE_HOST_EMULATION) && defined(__CUDA_ARCH__)
    int v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
#else
    return *p;
#endif
}

__device__ __forceinline__ unsigned short load_in_order(const unsigned short* p) {
#if !defined(METRALE_HOST_EMULATION) && defined(__CUDA_ARCH__)
    unsigned short v;
    asm volatile("ld.relaxed.gpu.global.b16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
#else
    return *p;
#endif
}
