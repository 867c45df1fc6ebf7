// A decode launch's timeline, for tools/decode_timeline.py: compiled in only with
// -DMETRALE_TIMELINE (a measuring build; the kernels' outputs are unchanged, their timing a little).
// Thread 0 of every CTA stamps the GPU's global timer at the kernel's marks into the module's
// metrale_timeline[kind][launch % TL_LAUNCHES][cta][mark], kind naming the kernel within its
// module and launch counted per kind (every CTA of a launch starts before the next launch's
// first, as programmatic launches are let in only once all CTAs of the one before have started).
// Mark 0 is the CTA's start, 1 the return of its PDL wait, 5 its end.
#pragma once

#ifdef METRALE_TIMELINE
#define TL_KINDS 4
#define TL_LAUNCHES 64
#define TL_CTAS 2048
#ifndef TL_MARKS
#define TL_MARKS 6  // 9 with tools/decode_timeline.py --row-marks (marks 6-8: the one-launch decode's rows)
#endif
__device__ unsigned long long metrale_timeline[TL_KINDS][TL_LAUNCHES][TL_CTAS][TL_MARKS];
__device__ unsigned metrale_timeline_ctas[TL_KINDS];

__device__ __forceinline__ unsigned long long tl_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");
    return t;
}

struct Timeline {
    unsigned long long* row;  // this CTA's marks (thread 0), or null
    __device__ explicit Timeline(int kind) : row(nullptr) {
        if (threadIdx.x != 0) return;
        const unsigned ctas = gridDim.x * gridDim.y * gridDim.z;
        const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        const unsigned n = atomicAdd(&metrale_timeline_ctas[kind], 1u);
        if (cta < TL_CTAS) row = metrale_timeline[kind][(n / ctas) % TL_LAUNCHES][cta];
        if (row != nullptr) row[0] = tl_now();
    }
    __device__ void mark(int m) const {
        if (row != nullptr) row[m] = tl_now();
    }
};
#define TL_BEGIN(kind) const Timeline timeline_(kind)
#define TL_MARK(m) timeline_.mark(m)
// A device function's marks: it takes the CTA's row as a last parameter (null where its caller
// has no timeline), passed on by TL_ROW_ARG and handed in by TL_ROW_HERE; a mark past the build's
// TL_MARKS is not taken (moe.cu's routing warp: marks 6-8 in the TL_MARKS 9 build).
#define TL_ROW_PARAM , unsigned long long* tl_row = nullptr
#define TL_ROW_ARG , tl_row
#define TL_ROW_HERE , timeline_.row
#define TL_ROW_MARK(m)                                            \
    do {                                                          \
        if ((m) < TL_MARKS && tl_row != nullptr) tl_row[m] = tl_now(); \
    } while (0)
#else
#define TL_BEGIN(kind)
#define TL_MARK(m)
#define TL_ROW_PARAM
#define TL_ROW_ARG
#define TL_ROW_HERE
#define TL_ROW_MARK(m) \
    do {               \
    } while (0)
#endif
