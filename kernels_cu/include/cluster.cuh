// Thread block clusters (sm_90+): the CTAs of a cluster run at once on one GPC, meet at a cluster
// barrier and read each other's shared memory (distributed shared memory) without going through
// L2. A kernel launched without a cluster is a cluster of one, as it is below sm_90. The host
// emulation runs a cluster's CTAs as run_cluster does (emulate.h), and any other launch as a
// cluster of one.
#pragma once

#if !defined(METRALE_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define METRALE_CLUSTERS 1
#endif

__device__ __forceinline__ unsigned cluster_ctas() {
    unsigned n = 1;
#ifdef METRALE_CLUSTERS
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#elif defined(METRALE_HOST_EMULATION)
    n = emulated_cluster_ctas();
#endif
    return n;
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#ifdef METRALE_CLUSTERS
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#elif defined(METRALE_HOST_EMULATION)
    r = emulated_cluster_ctarank();
#endif
    return r;
}

// Every thread of the cluster's CTAs: the shared-memory writes before it are visible to the
// cluster's reads after it. cluster_arrive then cluster_wait is the same barrier split in two: a
// CTA arrives when it is done reading the others' shared memory and waits only before it leaves.
__device__ __forceinline__ void cluster_arrive() {
#ifdef METRALE_CLUSTERS
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#elif defined(METRALE_HOST_EMULATION)
    if (emulated_cluster != nullptr) emulated_cluster_arrive();
#endif
}

// cluster_arrive without its release: for a barrier that only keeps a CTA's shared memory alive
// until the others are done reading it. Their reads have returned by then (each value is used
// before the arrive), and the arrive does not wait for the global stores before it, as a release
// does.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#ifdef METRALE_CLUSTERS
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#elif defined(METRALE_HOST_EMULATION)
    if (emulated_cluster != nullptr) emulated_cluster_arrive();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#ifdef METRALE_CLUSTERS
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
#ifdef METRALE_HOST_EMULATION
    if (emulated_cluster != nullptr) {
        emulated_cluster_wait();
        return;
    }
#endif
    __syncthreads();
#endif
}

__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}

// The float at the same shared-memory address as `mine`, in the cluster's CTA `rank`.
__device__ __forceinline__ float cluster_load(const float* mine, unsigned rank) {
#ifdef METRALE_CLUSTERS
    const unsigned local = (unsigned)__cvta_generic_to_shared(mine);
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote));
    return v;
#elif defined(METRALE_HOST_EMULATION)
    return emulated_cluster == nullptr ? *mine : emulated_cluster_load(mine, rank);
#else
    (void)rank;
    return *mine;
#endif
}
