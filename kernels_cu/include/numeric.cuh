// bf16 / fp8 e4m3 conversions and vector loads, header-light so NVRTC needs no CUDA headers.
// bf16 travels as raw 16-bit words; rounding is RNE, as torch does.
#pragma once

typedef unsigned short bf16_t;
typedef unsigned char fp8_t;  // e4m3fn bits

#define METRALE_NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0;  // NaN, as torch
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Round through bf16: what torch does when a float result is stored in a bf16 tensor.
__device__ __forceinline__ float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// SwiGLU of one column, in the rounding order of torch's silu(g) * u on bf16 tensors (the product
// is rounded where it is stored).
__device__ __forceinline__ float silu_mul(float g, float u) { return round_bf16(g / (1.0f + expf(-g))) * u; }

// e4m3 in software, for GPUs without the conversion instructions (below sm_89): the bytes of
// cvt.rn.satfinite.e4m3x2.f32 (RNE; +-448 past the range, infinities too; NaN as 0x7f with its
// sign) and the exact f16 of a byte (NaN as 0x7fff with its sign).
__device__ __forceinline__ unsigned e4m3_from_f32(float x) {
    const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fabsf(x);
    if (!(a == a)) return sign | 0x7fu;
    if (a >= 448.0f) return sign | 0x7eu;
    if (a < 0.015625f) return sign | (unsigned)rintf(a * 512.0f);  // below 2^-6: quanta of 2^-9 (8: 2^-6)
    const int e = (int)(__float_as_uint(a) >> 23) - 127;  // -6 .. 8: the quantum is 2^(e - 3)
    const unsigned n = (unsigned)rintf(a * __uint_as_float((unsigned)(130 - e) << 23));  // 8 .. 16, exact scaling
    return sign | (((unsigned)(e + 7) << 3) + n - 8);  // n = 16 carries into the next exponent
}

__device__ __forceinline__ unsigned e4m3_to_f16_bits(unsigned byte) {
    const unsigned sign = (byte & 0x80u) << 8, e = (byte >> 3) & 15u, m = byte & 7u;
    if (e == 15u && m == 7u) return sign | 0x7fffu;
    if (e != 0u) return sign | (e + 8u) << 10 | m << 7;
    if (m == 0u) return sign;
    const unsigned p = m >= 4u ? 2u : (m >= 2u ? 1u : 0u);  // m * 2^-9: its leading bit, 2^(p - 9)
    return sign | (p + 6u) << 10 | (m - (1u << p)) << (10u - p);
}

#ifdef METRALE_HOST_EMULATION
// kernels_cu/host/: the same conversions in software, for the CPU emulation tests.
unsigned short f32x2_to_e4m3x2(float lo, float hi);
void e4m3x2_to_f32x2(unsigned short v, float& lo, float& hi);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
__device__ __forceinline__ unsigned short f32x2_to_e4m3x2(float lo, float hi) {
    return (unsigned short)(e4m3_from_f32(lo) | e4m3_from_f32(hi) << 8);
}

__device__ __forceinline__ void e4m3x2_to_f32x2(unsigned short v, float& lo, float& hi) {
    const unsigned short h_lo = (unsigned short)e4m3_to_f16_bits(v & 0xffu);
    const unsigned short h_hi = (unsigned short)e4m3_to_f16_bits(v >> 8);
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(h_lo));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(h_hi));
}
#else
// Two floats -> two e4m3 bytes (lo in bits 0-7), RNE, saturated to +-448 (NaN stays NaN).
__device__ __forceinline__ unsigned short f32x2_to_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void e4m3x2_to_f32x2(unsigned short v, float& lo, float& hi) {
    unsigned int h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
    unsigned short h_lo = (unsigned short)(h2 & 0xffffu);
    unsigned short h_hi = (unsigned short)(h2 >> 16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(h_lo));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(h_hi));
}
#endif

// W 32-bit words with the alignment that makes the compiler emit one vector load/store.
template <int W>
struct alignas(4 * W) Words {
    unsigned int w[W];
};

// Load N consecutive elements (bf16 or e4m3) as floats; the pointer is aligned to N elements.
template <int N>
__device__ __forceinline__ void load_vec(const bf16_t* p, float* f) {
    if constexpr (N == 1) {
        f[0] = bf16_to_f32(*p);
    } else {
        Words<N / 2> v = *reinterpret_cast<const Words<N / 2>*>(p);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            f[2 * i] = __uint_as_float(v.w[i] << 16);
            f[2 * i + 1] = __uint_as_float(v.w[i] & 0xffff0000u);
        }
    }
}

template <int N>
__device__ __forceinline__ void load_vec(const fp8_t* p, float* f) {
    if constexpr (N == 1) {
        float unused;
        e4m3x2_to_f32x2((unsigned short)*p, f[0], unused);
    } else if constexpr (N == 2) {
        e4m3x2_to_f32x2(*reinterpret_cast<const unsigned short*>(p), f[0], f[1]);
    } else {
        Words<N / 4> v = *reinterpret_cast<const Words<N / 4>*>(p);
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            e4m3x2_to_f32x2((unsigned short)(v.w[i] & 0xffffu), f[4 * i], f[4 * i + 1]);
            e4m3x2_to_f32x2((unsigned short)(v.w[i] >> 16), f[4 * i + 2], f[4 * i + 3]);
        }
    }
}

// Store N floats as bf16 (RNE).
template <int N>
__device__ __forceinline__ void store_vec(bf16_t* p, const float* f) {
    if constexpr (N == 1) {
        *p = f32_to_bf16(f[0]);
    } else {
        Words<N / 2> v;
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            v.w[i] = (unsigned int)f32_to_bf16(f[2 * i]) |
                     ((unsigned int)f32_to_bf16(f[2 * i + 1]) << 16);
        }
        *reinterpret_cast<Words<N / 2>*>(p) = v;
    }
}

// Store N floats as e4m3 (RNE, satfinite); N is 1 or a multiple of 4.
template <int N>
__device__ __forceinline__ void store_vec(fp8_t* p, const float* f) {
    if constexpr (N == 1) {
        *p = (fp8_t)(f32x2_to_e4m3x2(f[0], 0.0f) & 0xffu);
    } else {
        Words<N / 4> v;
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            v.w[i] = (unsigned int)f32x2_to_e4m3x2(f[4 * i], f[4 * i + 1]) |
                     ((unsigned int)f32x2_to_e4m3x2(f[4 * i + 2], f[4 * i + 3]) << 16);
        }
        *reinterpret_cast<Words<N / 4>*>(p) = v;
    }
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}
