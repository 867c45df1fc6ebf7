// Warp-level tensor-core operations (sm_80+) used by the decode attention kernel: one
// m16n8k16 MMA with fp32 accumulators, the 8x8 b16 transpose across a warp, and the packing of
// two floats into one bf16x2 / f16x2 operand register. The host emulation (kernels_cu/host/
// emulate.h) defines the same functions for the CPU tests.
//
// Fragment layout (PTX ISA, "mma.m16n8k16"), lane = 4 * g + c:
//   A (16 x 16, row-major):  a[0] = A[g][2c, 2c+1]   a[1] = A[g+8][2c, 2c+1]
//                            a[2] = A[g][2c+8, +9]   a[3] = A[g+8][2c+8, +9]
//   B (16 x 8, "col"):       b[0] = B[2c, 2c+1][g]   b[1] = B[2c+8, 2c+9][g]
//   C (16 x 8, fp32):        d[0], d[1] = C[g][2c, 2c+1]   d[2], d[3] = C[g+8][2c, 2c+1]
// Each 32-bit register holds two 16-bit elements, the lower index in the low half.
#pragma once
#include "numeric.cuh"

#ifdef METRALE_HOST_EMULATION
void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b);
void mma_f16_16816(float* d, const unsigned* a, const unsigned* b);
unsigned movmatrix_trans(unsigned a);
unsigned pack_bf16x2(float lo, float hi);
unsigned pack_f16x2(float lo, float hi);
void unpack_f16x2(unsigned v, float& lo, float& hi);
unsigned e4m3x4_lo_to_f16x2(unsigned v);
unsigned e4m3x4_hi_to_f16x2(unsigned v);
unsigned mul_bf16x2(unsigned a, unsigned b);
unsigned mul_f16x2(unsigned a, unsigned b);
unsigned prmt(unsigned a, unsigned b, unsigned s);
float ex2_ftz(float x);
#else
// d += A B (bf16 inputs).
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += A B (f16 inputs).
__device__ __forceinline__ void mma_f16_16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The warp's 8x8 matrix (lane 4g + c holds row g, columns 2c, 2c+1), transposed into the same
// layout: the result holds M[2c][g], M[2c+1][g].
__device__ __forceinline__ unsigned movmatrix_trans(unsigned a) {
    unsigned d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
    return d;
}

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ void unpack_f16x2(unsigned v, float& lo, float& hi) {
    unsigned short l = (unsigned short)(v & 0xffffu), h = (unsigned short)(v >> 16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(l));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(h));
}

// Bytes 0-1 (2-3) of four e4m3 values as an f16x2 register: exact (e4m3 is a subset of f16). The
// halves are split inside the asm so that the conversion reads the high one in place (R.H1), with
// no shift before it.
__device__ __forceinline__ unsigned e4m3x4_lo_to_f16x2(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890  // no e4m3 conversion: numeric.cuh's, the same bits
    return e4m3_to_f16_bits(v & 0xffu) | e4m3_to_f16_bits((v >> 8) & 0xffu) << 16;
#else
    unsigned d;
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;\n}" : "=r"(d) : "r"(v));
    return d;
#endif
}
__device__ __forceinline__ unsigned e4m3x4_hi_to_f16x2(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    return e4m3_to_f16_bits((v >> 16) & 0xffu) | e4m3_to_f16_bits(v >> 24) << 16;
#else
    unsigned d;
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;\n}" : "=r"(d) : "r"(v));
    return d;
#endif
}

// a * b, two bf16 lanes, each rounded to bf16 (RNE) once: the product of two bf16 values is exact
// in fp32, so this equals round_bf16(float(a) * float(b)) lane by lane.
__device__ __forceinline__ unsigned mul_bf16x2(unsigned a, unsigned b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900  // no bf16 multiply: the fp32 product, rounded once
    return pack_bf16x2(__uint_as_float(a << 16) * __uint_as_float(b << 16),
                       __uint_as_float(a & 0xffff0000u) * __uint_as_float(b & 0xffff0000u));
#else
    unsigned d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
#endif
}

// a * b, two f16 lanes, each rounded to f16 (RNE) once.
__device__ __forceinline__ unsigned mul_f16x2(unsigned a, unsigned b) {
    unsigned d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// Byte permute in PTX's default mode: byte i of the result is byte s[4i+2 : 4i] of (b:a), or,
// where selector bit 4i + 3 is set, that byte's sign bit in all eight bits (__byte_perm ignores
// bit 3).
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned s) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

// 2^x as the MUFU computes it, a result below 2^-126 flushed to zero (exp2f adds a range
// reduction for those; a probability that small is zero in P's f16 or bf16 anyway). -inf -> 0.
__device__ __forceinline__ float ex2_ftz(float x) {
    float d;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(d) : "f"(x));
    return d;
}
#endif

// The two halves of a bf16x2 register as floats.
__device__ __forceinline__ void unpack_bf16x2(unsigned v, float& lo, float& hi) {
    lo = __uint_as_float(v << 16);
    hi = __uint_as_float(v & 0xffff0000u);
}
