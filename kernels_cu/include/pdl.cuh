// Programmatic dependent launch (sm_90+): a kernel launched with the programmatic-serialization
// attribute may start while the kernel before it in the stream still runs. Such a kernel calls
// pdl_wait() before it touches any memory an earlier kernel writes or reads (only constant data,
// such as weights, may be read before it), in every CTA: the wait returns once the previous grid
// has completed and its writes are visible, and a grid that waited completes only after its own
// predecessor did, so the order holds down the whole chain. pdl_launch_dependents() lets the next
// such kernel be scheduled onto SMs this grid's finished CTAs free. Both are no-ops in a normal
// launch, below sm_90 and in the host emulation.
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
