// Runs kernel code of kernels_cu/ on the CPU, for the tests that check its bytes against the
// torch codecs (and fused kernels against the kernels they replace) where no GPU is present.
// A block's threads are fibers (ucontext) of the calling thread, run in turn: deterministic, and
// a switch costs far less than an OS thread's. A cluster's CTAs (run_cluster) run on OS threads of
// their own, one at a time, each with its own __shared__ variables (thread_local); cluster.cuh's
// barriers and distributed shared-memory loads work across them. __syncwarp / __syncthreads are barriers of the
// warp / block; __shfl_xor_sync and __shfl_sync exchange through the warp's slots; the __f*_rn intrinsics are
// the host's IEEE fp32 operations (compile with -ffp-contract=off); e4m3 conversions are done in
// software; the tensor-core MMA and movmatrix of mma.cuh exchange operands through per-warp
// words, products exact in fp32, summed in order. Not part of any kernel module: only the host libraries of this folder include it.
#pragma once
#include <map>
#include <sys/mman.h>
#include <ucontext.h>

#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define METRALE_HOST_EMULATION 1
#define __device__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __global__
#define __constant__ static
#define __shared__ static thread_local  // a CTA a thread: a cluster's CTAs each have their own
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct alignas(8) float2 {
    float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }

struct EmulatedIndex {
    unsigned x, y, z;
};

// The block being run: its fibers, and which one runs now (the index variables are set on
// every switch to a fiber).
struct EmulatedBlock {
    ucontext_t scheduler;
    std::vector<ucontext_t> fibers;
    static constexpr size_t kStack = 256 * 1024;
    struct Unmap {
        void operator()(char* p) const { munmap(p, kStack); }
    };
    std::vector<std::unique_ptr<char, Unmap>> stacks;  // mapped: zeroed, a page only where a fiber touches it
    std::vector<bool> finished;
    const std::function<void()>* fn = nullptr;
    unsigned current = 0;
    unsigned long long progress = 0;  // barrier releases and finished fibers
};
inline thread_local EmulatedBlock emulated;
inline thread_local EmulatedIndex threadIdx{0, 0, 0};
inline thread_local EmulatedIndex blockIdx{0, 0, 0};
inline thread_local EmulatedIndex blockDim{32, 1, 1};
inline thread_local EmulatedIndex gridDim{1, 1, 1};  // set by the host library that runs a grid

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

inline thread_local std::deque<EmulatedBarrier> emulated_warps;  // barriers do not move: no vector
inline thread_local EmulatedBarrier* emulated_whole = nullptr;
inline thread_local std::vector<float> emulated_slots;  // 32 shuffle slots per warp
inline thread_local std::vector<unsigned> emulated_words;  // 8 exchange words per thread (mma.cuh)

inline thread_local std::map<int, EmulatedBarrier> emulated_named;  // bar.sync id, count: made at first use in a block

inline void __syncwarp() { emulated_warps[threadIdx.x / 32].arrive_and_wait(); }
inline void emulated_named_sync(int id, unsigned threads) { emulated_named.try_emplace(id, threads).first->second.arrive_and_wait(); }
inline void __syncthreads() { emulated_whole->arrive_and_wait(); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
// A warp's exchange of 4-byte words through its shuffle slots: this lane's bits in, lane src's out.
inline unsigned emulated_exchange(unsigned bits, unsigned src) {
    float* lanes = emulated_slots.data() + threadIdx.x / 32 * 32;
    std::memcpy(&lanes[threadIdx.x & 31], &bits, 4);
    __syncwarp();
    unsigned other;
    std::memcpy(&other, &lanes[src & 31], 4);
    __syncwarp();
    return other;
}
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    return __uint_as_float(emulated_exchange(__float_as_uint(v), (threadIdx.x & 31) ^ lane_mask));
}
inline int __shfl_sync(unsigned, int v, int src_lane) { return (int)emulated_exchange((unsigned)v, src_lane); }
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
// Blocks run one after another: atomics are plain read-modify-writes, fences and L2 loads plain.
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p += v; return old; }
inline unsigned atomicExch(unsigned* p, unsigned v) { const unsigned old = *p; *p = v; return old; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    const unsigned long long old = *p;
    *p += v;
    return old;
}
inline void __threadfence() {}
template <class T>
inline T __ldcg(const T* p) { return *p; }

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

// mma.cuh on the CPU. The lane's words: 0-3 A, 4-5 B, 6 movmatrix.
inline unsigned* emulated_warp_words() { return emulated_words.data() + threadIdx.x / 32 * 32 * 8; }

// redux.sync's unsigned max / min over the warp, through each lane's first exchange word.
template <bool MAX>
inline unsigned emulated_reduce(unsigned v) {
    unsigned* words = emulated_warp_words();
    words[(threadIdx.x & 31) * 8] = v;
    __syncwarp();
    unsigned r = words[0];
    for (int l = 1; l < 32; ++l) r = MAX ? std::max(r, words[l * 8]) : std::min(r, words[l * 8]);
    __syncwarp();
    return r;
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) { return emulated_reduce<true>(v); }
inline unsigned __reduce_min_sync(unsigned, unsigned v) { return emulated_reduce<false>(v); }

inline float emulated_bf16(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
inline float emulated_f16(unsigned short h) {
    _Float16 f;
    std::memcpy(&f, &h, 2);
    return (float)f;
}
inline unsigned short emulated_to_f16(float x) {
    const _Float16 f = (_Float16)x;  // RNE
    unsigned short h;
    std::memcpy(&h, &f, 2);
    return h;
}
inline unsigned short emulated_to_bf16(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// d += A B for the warp's m16n8k16 fragments (layout: mma.cuh), elements decoded by `elem`.
inline void emulated_mma(float* d, const unsigned* a, const unsigned* b, float (*elem)(unsigned short)) {
    unsigned* words = emulated_warp_words();
    const unsigned lane = threadIdx.x & 31, g = lane / 4, c = lane % 4;
    for (int i = 0; i < 4; ++i) words[lane * 8 + i] = a[i];
    words[lane * 8 + 4] = b[0];
    words[lane * 8 + 5] = b[1];
    __syncwarp();
    auto half = [&](unsigned w, unsigned odd) { return elem((unsigned short)(odd ? w >> 16 : w & 0xffffu)); };
    auto A = [&](unsigned row, unsigned k) {
        return half(words[((row % 8) * 4 + (k % 8) / 2) * 8 + (row >= 8) + 2 * (k >= 8)], k % 2);
    };
    auto B = [&](unsigned k, unsigned col) { return half(words[(col * 4 + (k % 8) / 2) * 8 + 4 + (k >= 8)], k % 2); };
    float r[4];
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned row = g + (i >= 2 ? 8 : 0), col = 2 * c + (i & 1);
        float acc = d[i];
        for (unsigned k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
        r[i] = acc;
    }
    __syncwarp();
    for (int i = 0; i < 4; ++i) d[i] = r[i];
}
inline void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) { emulated_mma(d, a, b, emulated_bf16); }
inline void mma_f16_16816(float* d, const unsigned* a, const unsigned* b) { emulated_mma(d, a, b, emulated_f16); }

inline unsigned movmatrix_trans(unsigned a) {
    unsigned* words = emulated_warp_words();
    const unsigned lane = threadIdx.x & 31, g = lane / 4, c = lane % 4;
    words[lane * 8 + 6] = a;
    __syncwarp();
    auto m = [&](unsigned row, unsigned col) {
        const unsigned w = words[(row * 4 + col / 2) * 8 + 6];
        return col % 2 ? w >> 16 : w & 0xffffu;
    };
    const unsigned r = m(2 * c, g) | (m(2 * c + 1, g) << 16);
    __syncwarp();
    return r;
}

inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}

inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long bytes = x | (unsigned long long)y << 32;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((bytes >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
    return r;
}

inline unsigned pack_bf16x2(float lo, float hi) { return emulated_to_bf16(lo) | ((unsigned)emulated_to_bf16(hi) << 16); }
inline unsigned pack_f16x2(float lo, float hi) { return emulated_to_f16(lo) | ((unsigned)emulated_to_f16(hi) << 16); }
inline void unpack_f16x2(unsigned v, float& lo, float& hi) {
    lo = emulated_f16((unsigned short)(v & 0xffffu));
    hi = emulated_f16((unsigned short)(v >> 16));
}
inline unsigned e4m3x4_lo_to_f16x2(unsigned v) {
    return pack_f16x2(e4m3_value(v & 0xffu), e4m3_value((v >> 8) & 0xffu));
}
inline unsigned mul_bf16x2(unsigned a, unsigned b) {
    return pack_bf16x2(emulated_bf16(a & 0xffffu) * emulated_bf16(b & 0xffffu),
                       emulated_bf16(a >> 16) * emulated_bf16(b >> 16));
}
inline unsigned mul_f16x2(unsigned a, unsigned b) {  // an f16 product is exact in fp32: one rounding
    return pack_f16x2(emulated_f16(a & 0xffffu) * emulated_f16(b & 0xffffu),
                      emulated_f16(a >> 16) * emulated_f16(b >> 16));
}
inline float ex2_ftz(float x) {
    const float r = std::exp2(x);
    return r < 1.17549435e-38f ? 0.0f : r;
}
inline unsigned prmt(unsigned a, unsigned b, unsigned s) {
    const unsigned long long bytes = a | (unsigned long long)b << 32;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned sel = (s >> (4 * i)) & 15u, byte = (unsigned)(bytes >> (8 * (sel & 7))) & 0xffu;
        r |= (sel & 8 ? (byte & 0x80u ? 0xffu : 0u) : byte) << (8 * i);
    }
    return r;
}
inline unsigned e4m3x4_hi_to_f16x2(unsigned v) {
    return pack_f16x2(e4m3_value((v >> 16) & 0xffu), e4m3_value(v >> 24));
}

inline void emulated_fiber() {
    (*emulated.fn)();
    emulated.finished[emulated.current] = true;
    ++emulated.progress;
}  // returns to uc_link: the scheduler

// Make block `block`'s `threads` threads (a multiple of 32, at most 1024) fibers of fn, `whole`
// their block barrier.
inline void emulated_start_block(EmulatedIndex block, unsigned threads, const std::function<void()>& fn,
                                 EmulatedBarrier& whole) {
    emulated_warps.clear();
    for (unsigned w = 0; w < threads / 32; ++w) emulated_warps.emplace_back(32);
    emulated_whole = &whole;
    emulated_named.clear();
    emulated_slots.assign(threads, 0.0f);
    emulated_words.assign(threads * 8, 0u);
    emulated.fibers.resize(threads);
    while (emulated.stacks.size() < threads) {
        void* p = mmap(nullptr, EmulatedBlock::kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            std::fprintf(stderr, "emulated block: no memory for a thread's stack\n");
            std::abort();
        }
        emulated.stacks.emplace_back(static_cast<char*>(p));
    }
    emulated.finished.assign(threads, false);
    emulated.fn = &fn;
    for (unsigned i = 0; i < threads; ++i) {
        ucontext_t& f = emulated.fibers[i];
        getcontext(&f);
        f.uc_stack.ss_sp = emulated.stacks[i].get();
        f.uc_stack.ss_size = EmulatedBlock::kStack;
        f.uc_link = &emulated.scheduler;
        makecontext(&f, emulated_fiber, 0);
    }
    blockIdx = block;
    blockDim = {threads, 1, 1};
}

// Run the block's fibers in turn until every one has finished (true) or a whole pass moves none of
// them (false: they wait on a barrier that no thread of this block will release).
inline bool emulated_run_fibers(unsigned threads) {
    for (;;) {
        const unsigned long long before = emulated.progress;
        unsigned left = 0;
        for (unsigned i = 0; i < threads; ++i) {
            if (emulated.finished[i]) continue;
            emulated.current = i;
            threadIdx = {i, 0, 0};
            swapcontext(&emulated.scheduler, &emulated.fibers[i]);
            left += !emulated.finished[i];
        }
        if (left == 0) return true;
        if (emulated.progress == before) return false;
    }
}

// Run fn on the `threads` threads (a multiple of 32, at most 1024) of block `block`.
inline void run_block(EmulatedIndex block, unsigned threads, const std::function<void()>& fn) {
    EmulatedBarrier whole(threads);
    emulated_start_block(block, threads, fn, whole);
    if (!emulated_run_fibers(threads)) {
        std::fprintf(stderr, "emulated block (%u, %u): threads wait on a barrier others never reach\n", block.x,
                     block.y);
        std::abort();
    }
}

// A cluster being run (run_cluster): its barrier and each CTA's thread-local storage. Only one of
// its OS threads runs at a time (the one whose turn it is, holding `mutex`), so its fields need no
// atomics, and a CTA waiting for its turn has its shared memory where the others can read it.
struct EmulatedCluster {
    unsigned size = 1, threads = 0;
    unsigned arrived = 0;           // arrivals at the barrier's current phase
    unsigned long long phase = 0;   // completed barriers
    std::vector<const char*> anchors;  // each CTA's emulated_tls_anchor
    std::mutex mutex;
    std::condition_variable turn_changed;
    std::vector<bool> finished;  // each CTA's threads all done
    unsigned turn = 0, idle_turns = 0;
    bool stuck = false;
    bool all_finished() const {
        for (bool f : finished)
            if (!f) return false;
        return true;
    }
};
inline EmulatedCluster* emulated_cluster = nullptr;  // set while a cluster runs (shared by its threads)
inline thread_local unsigned emulated_cluster_rank = 0;
inline thread_local char emulated_tls_anchor;  // a CTA's __shared__ variables lie at fixed offsets from it
inline thread_local std::vector<unsigned long long> emulated_arrival;  // each thread's phase at its arrive

inline unsigned emulated_cluster_ctas() { return emulated_cluster == nullptr ? 1u : emulated_cluster->size; }
inline unsigned emulated_cluster_ctarank() { return emulated_cluster == nullptr ? 0u : emulated_cluster_rank; }
inline void emulated_cluster_arrive() {
    EmulatedCluster& c = *emulated_cluster;
    emulated_arrival[threadIdx.x] = c.phase;
    if (++c.arrived == c.size * c.threads) c.arrived = 0, ++c.phase;
    ++emulated.progress;
}
inline void emulated_cluster_wait() {
    while (emulated_cluster->phase <= emulated_arrival[threadIdx.x]) emulated_yield();
}
// The value at `mine`'s address in CTA `rank`'s shared memory: the same offset from its anchor.
template <class T>
inline T emulated_cluster_load(const T* mine, unsigned rank) {
    const char* at = reinterpret_cast<const char*>(mine) - &emulated_tls_anchor + emulated_cluster->anchors[rank];
    T v;
    std::memcpy(&v, at, sizeof v);
    return v;
}

// Run fn on the CTAs `blocks` as one cluster, rank i being blocks[i]: an OS thread a CTA, each in
// turn until its threads have all finished or wait on a cluster barrier (or, within the CTA, on one
// that a thread still waiting on the cluster's would release). Every thread stays until all have
// finished, as a CTA's shared memory outlives its reads on a GPU. Aborts where a whole round of
// turns moves no thread.
inline void run_cluster(const std::vector<EmulatedIndex>& blocks, unsigned threads, const std::function<void()>& fn) {
    EmulatedCluster c;
    c.size = (unsigned)blocks.size();
    c.threads = threads;
    c.anchors.assign(c.size, nullptr);
    c.finished.assign(c.size, false);
    const EmulatedIndex grid = gridDim;
    emulated_cluster = &c;
    std::vector<std::thread> ctas;
    for (unsigned r = 0; r < c.size; ++r)
        ctas.emplace_back([&, r] {
            gridDim = grid;
            emulated_cluster_rank = r;
            std::unique_lock<std::mutex> lock(c.mutex);
            c.anchors[r] = &emulated_tls_anchor;
            const auto my_turn = [&] { return c.turn == r || c.stuck; };
            c.turn_changed.wait(lock, my_turn);
            if (c.stuck) return;
            EmulatedBarrier whole(threads);
            emulated_arrival.assign(threads, 0);
            emulated_start_block(blocks[r], threads, fn, whole);
            bool finished = false;
            while (!finished) {
                const unsigned long long before = emulated.progress;
                finished = emulated_run_fibers(threads);
                c.idle_turns = emulated.progress == before ? c.idle_turns + 1 : 0;
                c.finished[r] = finished;
                if (c.idle_turns > c.size) c.stuck = true;
                for (unsigned k = 1; k <= c.size; ++k) {  // the turn goes to the next CTA still running
                    if (!c.finished[(r + k) % c.size]) {
                        c.turn = (r + k) % c.size;
                        break;
                    }
                }
                c.turn_changed.notify_all();
                if (c.stuck) return;
                if (!finished) c.turn_changed.wait(lock, my_turn);
                if (c.stuck) return;
            }
            c.turn_changed.wait(lock, [&] { return c.all_finished() || c.stuck; });  // shared memory stays readable
        });
    for (std::thread& t : ctas) t.join();
    emulated_cluster = nullptr;
    if (c.stuck) {
        std::fprintf(stderr, "emulated cluster: its threads wait on a barrier others never reach\n");
        std::abort();
    }
}

// Run fn on the 32 lanes of one emulated warp.
inline void run_warp(const std::function<void()>& fn) { run_block({0, 0, 0}, 32, fn); }

// Run fn on every block of a (gx, gy) grid of `threads`-thread blocks, one block after another.
inline void run_grid(unsigned gx, unsigned gy, unsigned threads, const std::function<void()>& fn) {
    gridDim = {gx, gy, 1};
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) run_block({x, y, 0}, threads, fn);
    gridDim = {1, 1, 1};
}
