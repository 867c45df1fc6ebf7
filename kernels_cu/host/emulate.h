// Runs the warp-level KV-cache code of kernels_cu/include (kv_write.cuh, kv_formats.cuh) on the
// CPU, for the tests that check its bytes against the torch codecs where no GPU is present.
// One warp = 32 std::threads; __syncwarp is a barrier; the __f*_rn intrinsics are the host's
// IEEE fp32 operations (compile with -ffp-contract=off); e4m3 conversions are done in software.
// Not part of any kernel module: only kv_codec_host.cpp includes it.
#pragma once
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
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
inline thread_local EmulatedIndex threadIdx{0, 0, 0};
inline thread_local EmulatedIndex blockIdx{0, 0, 0};
inline std::barrier<>* emulated_warp = nullptr;

inline void __syncwarp() { emulated_warp->arrive_and_wait(); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float fabsf(float x) { return std::fabs(x); }
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

// Run fn on the 32 lanes of one emulated warp.
inline void run_warp(const std::function<void()>& fn) {
    std::barrier<> warp(32);
    emulated_warp = &warp;
    std::vector<std::thread> lanes;
    for (unsigned lane = 0; lane < 32; ++lane)
        lanes.emplace_back([&fn, lane] {
            threadIdx = {lane, 0, 0};
            fn();
        });
    for (auto& t : lanes) t.join();
}
