// Runs kernel code of kernels_cu/ on the CPU, for the tests that check its bytes against the
// torch codecs (and fused kernels against the kernels they replace) where no GPU is present.
// A block's threads are fibers (ucontext) of the calling thread, run in turn: deterministic, and
// a switch costs far less than an OS thread's. __syncwarp / __syncthreads are barriers of the
// warp / block; __shfl_xor_sync exchanges through the warp's slots; the __f*_rn intrinsics are
// the host's IEEE fp32 operations (compile with -ffp-contract=off); e4m3 conversions are done in
// software. Not part of any kernel module: only the host libraries of this folder include it.
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <vector>

#define METRALE_HOST_EMULATION 1
#define __device__
#define __forceinline__ inline
#define __global__
#define __constant__ static
#define __shared__ static
#define __launch_bounds__(...)

struct EmulatedIndex {
    unsigned x, y, z;
};

// The block being run: its fibers, and which one runs now (the index variables are set on
// every switch to a fiber).
struct EmulatedBlock {
    ucontext_t scheduler;
    std::vector<ucontext_t> fibers;
    std::vector<std::vector<char>> stacks;
    std::vector<bool> finished;
    const std::function<void()>* fn = nullptr;
    unsigned current = 0;
    unsigned long long progress = 0;  // barrier releases and finished fibers
};
inline EmulatedBlock emulated;
inline EmulatedIndex threadIdx{0, 0, 0};
inline EmulatedIndex blockIdx{0, 0, 0};
inline EmulatedIndex blockDim{32, 1, 1};

inline void emulated_yield() { swapcontext(&emulated.fibers[emulated.current], &emulated.scheduler); }

class EmulatedBarrier {
  public:
    explicit EmulatedBarrier(unsigned count) : count_(count) {}
    void arrive_and_wait() {
        const unsigned long long phase = phase_;
        if (++arrived_ == count_) {
            arrived_ = 0;
            ++phase_;
            ++emulated.progress;
            return;
        }
        while (phase_ == phase) emulated_yield();
    }

  private:
    unsigned count_;
    unsigned arrived_ = 0;
    unsigned long long phase_ = 0;
};

inline std::deque<EmulatedBarrier> emulated_warps;  // barriers do not move: no vector
inline EmulatedBarrier* emulated_whole = nullptr;
inline std::vector<float> emulated_slots;  // 32 shuffle slots per warp

inline void __syncwarp() { emulated_warps[threadIdx.x / 32].arrive_and_wait(); }
inline void __syncthreads() { emulated_whole->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    float* lanes = emulated_slots.data() + threadIdx.x / 32 * 32;
    const unsigned lane = threadIdx.x & 31;
    lanes[lane] = v;
    __syncwarp();
    const float other = lanes[lane ^ lane_mask];
    __syncwarp();
    return other;
}
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float fabsf(float x) { return std::fabs(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }

inline float e4m3_value(unsigned byte) {
    const int e = (byte >> 3) & 15, m = byte & 7;
    if (e == 15 && m == 7) return NAN;
    const float v = e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    return (byte & 0x80) ? -v : v;
}

// Round to the nearest e4m3 value, ties to the even code, saturating at 448 (satfinite).
inline unsigned e4m3_byte(float x) {
    const unsigned sign = std::signbit(x) ? 0x80u : 0u;
    if (std::isnan(x)) return sign | 0x7fu;
    const double a = std::fabs((double)x);
    unsigned best = 0x7e;
    double best_d = a >= 448.0 ? 0.0 : 1e300;
    for (unsigned c = 0; c < 0x7f && a < 448.0; ++c) {
        const double d = std::fabs((double)e4m3_value(c) - a);
        if (d < best_d || (d == best_d && (c & 1) == 0)) best_d = d, best = c;
    }
    return sign | best;
}

inline unsigned short f32x2_to_e4m3x2(float lo, float hi) {
    return (unsigned short)(e4m3_byte(lo) | (e4m3_byte(hi) << 8));
}

inline void e4m3x2_to_f32x2(unsigned short v, float& lo, float& hi) {
    lo = e4m3_value(v & 0xffu);
    hi = e4m3_value(v >> 8);
}

inline void emulated_fiber() {
    (*emulated.fn)();
    emulated.finished[emulated.current] = true;
    ++emulated.progress;
}  // returns to uc_link: the scheduler

// Run fn on the `threads` threads (a multiple of 32, at most 1024) of block `block`.
inline void run_block(EmulatedIndex block, unsigned threads, const std::function<void()>& fn) {
    constexpr size_t kStack = 256 * 1024;
    EmulatedBarrier whole(threads);
    emulated_warps.clear();
    for (unsigned w = 0; w < threads / 32; ++w) emulated_warps.emplace_back(32);
    emulated_whole = &whole;
    emulated_slots.assign(threads, 0.0f);
    emulated.fibers.resize(threads);
    if (emulated.stacks.size() < threads) emulated.stacks.resize(threads, std::vector<char>(kStack));
    emulated.finished.assign(threads, false);
    emulated.fn = &fn;
    for (unsigned i = 0; i < threads; ++i) {
        ucontext_t& f = emulated.fibers[i];
        getcontext(&f);
        f.uc_stack.ss_sp = emulated.stacks[i].data();
        f.uc_stack.ss_size = kStack;
        f.uc_link = &emulated.scheduler;
        makecontext(&f, emulated_fiber, 0);
    }
    blockIdx = block;
    blockDim = {threads, 1, 1};
    for (unsigned left = threads; left > 0;) {
        const unsigned long long before = emulated.progress;
        left = 0;
        for (unsigned i = 0; i < threads; ++i) {
            if (emulated.finished[i]) continue;
            emulated.current = i;
            threadIdx = {i, 0, 0};
            swapcontext(&emulated.scheduler, &emulated.fibers[i]);
            left += !emulated.finished[i];
        }
        if (left > 0 && emulated.progress == before) {
            std::fprintf(stderr, "emulated block (%u, %u): threads wait on a barrier others never reach\n",
                         block.x, block.y);
            std::abort();
        }
    }
}

// Run fn on the 32 lanes of one emulated warp.
inline void run_warp(const std::function<void()>& fn) { run_block({0, 0, 0}, 32, fn); }
