// Cache writes of every side type: one warp stores one (token, KV head) vector, bit for bit as
// the torch codecs of kv/quant.py (docs/kv-formats.md is normative). Modules including this
// compile with --fmad=false, and every byte-deciding step is spelled with __f*_rn anyway.
//
// A store type `store_<name>` says how: element sides (bf16, fp8) convert each element; packed
// sides stage the vector in shared memory as fp32, rotate it (turbo) and multiply the InnerQ
// channel scales (when given), then the 16 lanes of a half-warp pick a group's codes and scale
// (two groups a pass, the group's sums by shuffles), and the warp packs the bytes.
#pragma once
#include "kv_formats.cuh"
#include "wht.cuh"

#define WRITE_MAX_D 512

struct WriteScratch {
    float y[WRITE_MAX_D];
    u8_t codes[WRITE_MAX_D];
    unsigned short scales[WRITE_MAX_D / KV_GROUP];
};

// Sum of a group's 16 values, one a lane (lanes 16h .. 16h + 15 hold a group), in xor-shuffle
// order: for h in 8, 4, 2, 1: v = v + v of lane ^ h. Addition commutes, so every lane of the
// group ends with the same bits. Run by the whole warp.
__device__ __forceinline__ float group_sum16(float v) {
#pragma unroll
    for (int h = 8; h > 0; h >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, h));
    return v;
}

__device__ __forceinline__ float group_amax16(float x) {
    float m = fabsf(x);
#pragma unroll
    for (int h = 8; h > 0; h >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, h));
    return m;
}

// ---- group quantizers: a group's 16 fp32 values, one a lane -> the lane's code, and the group's
// scale bits (returned in every lane of the group). Run by the whole warp, without divergence.
struct store_nvfp4 {
    static constexpr bool kPacked = true, kRotated = false;
    static constexpr int BITS = 4, SB = 1;
    __device__ static unsigned int group(float x, u8_t& code) {
        const unsigned int s8 = f32_to_e4m3(__fdiv_rn(group_amax16(x), 6.0f));
        const float s = e4m3_to_f32(s8);
        const float q = s == 0.0f ? 0.0f : __fdiv_rn(x, s);
        const float a = fabsf(q);
        const int mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
        code = (u8_t)(((q < 0.0f) << 3) | mag);
        return s8;
    }
};

template <int B>
struct store_codebook {
    static constexpr bool kPacked = true, kRotated = true;
    static constexpr int BITS = B, SB = 1, N = 1 << B;
    __device__ static unsigned int group(float x, u8_t& code) {
        const float ss = group_sum16(__fmul_rn(x, x));
        const float rms = __fsqrt_rn(__fdiv_rn(ss, 16.0f));
        const float u = __fdiv_rn(x, rms);  // NaN for an all-zero group (its code is set below)
        // The nearest level (ties go low): the count of midpoints below u; the level by selects over
        // constant-bank operands (an indexed constant load would serialize over the lanes' codes).
        int c = 0;
        float level = codebook_level<B>(0);
#pragma unroll
        for (int k = 0; k < N - 1; ++k) {
            const bool above =
                __fdiv_rn(__fadd_rn(codebook_level<B>(k), codebook_level<B>(k + 1)), 2.0f) < u;
            c += above;
            level = above ? codebook_level<B>(k + 1) : level;
        }
        const float cn = __fsqrt_rn(group_sum16(__fmul_rn(level, level)));  // norm of the chosen levels
        code = (u8_t)(ss == 0.0f ? N / 2 : c);
        return ss == 0.0f ? 0u : f32_to_e4m3(__fdiv_rn(__fsqrt_rn(ss), cn));
    }
};

typedef store_codebook<4> store_turbo4;
typedef store_codebook<3> store_turbo3;
typedef store_codebook<2> store_turbo2;

struct store_turbo8 {
    static constexpr bool kPacked = true, kRotated = true;
    static constexpr int BITS = 8, SB = 2;
    __device__ static unsigned int group(float x, u8_t& code) {
        const bf16_t sb = f32_to_bf16(__fdiv_rn(group_amax16(x), 448.0f));
        const float s = bf16_to_f32(sb);
        code = s == 0.0f ? 0 : (u8_t)f32_to_e4m3(__fdiv_rn(x, s));
        return sb;
    }
};

// ---- element sides ----------------------------------------------------------------------------
struct store_bf16 {
    static constexpr bool kPacked = false, kRotated = false;
    typedef bf16_t Elem;
    __device__ static bf16_t convert(bf16_t x, float) { return x; }
};

struct store_fp8 {
    static constexpr bool kPacked = false, kRotated = false;
    typedef fp8_t Elem;
    __device__ static fp8_t convert(bf16_t x, float scale) {
        return (fp8_t)f32_to_e4m3(__fdiv_rn(bf16_to_f32(x), scale));
    }
};

// Byte j of a vector's packed data: the codes whose bits fall in the stream bits [8j, 8j + 8).
template <int BITS>
__device__ __forceinline__ u8_t pack_byte(const u8_t* codes, int j) {
    if constexpr (BITS == 8) {
        return codes[j];
    } else {
        const int lo = 8 * j;
        unsigned int v = 0;
        for (int e = lo / BITS; e <= (lo + 7) / BITS; ++e) {
            const int shift = e * BITS - lo;
            v |= shift >= 0 ? (unsigned int)codes[e] << shift : (unsigned int)codes[e] >> -shift;
        }
        return (u8_t)v;
    }
}

// An element side's store_vector (below): by one warp, no scratch. Every element of the lane is
// loaded before any is stored: the compiler cannot tell src from the pool, so a load written after
// a store waits for it, and from global memory each of the D / 32 loads was a trip of its own.
template <class W, int D>
__device__ void store_elements(const bf16_t* src, void* pool, long long slot, int head, int hk, const float* scale) {
    constexpr int N = (D + 31) / 32;
    const int lane = threadIdx.x & 31;
    typename W::Elem* dst = static_cast<typename W::Elem*>(pool) + kv_vector(slot, head, hk) * D;
    const float sc = scale == nullptr ? 1.0f : *scale;
    bf16_t x[N];
#pragma unroll
    for (int n = 0; n < N; ++n)
        if (lane + 32 * n < D) x[n] = src[lane + 32 * n];
#pragma unroll
    for (int n = 0; n < N; ++n)
        if (lane + 32 * n < D) dst[lane + 32 * n] = W::convert(x[n], sc);
}

// KV head `head`'s D InnerQ scales in channel ((Hk, D) fp32), or null where channel is.
__device__ __forceinline__ const float* channel_row(const float* channel, int head, int d) {
    return channel == nullptr ? nullptr : channel + (long long)head * d;
}

// Store src (D bf16, original basis) at `slot` / `head` of `pool`. scale: the (1,) fp8 scale;
// signs: (2, D) WHT signs of a rotated side; channel: the D InnerQ scales of `head`, or null.
template <class W, int D>
__device__ void store_vector(const bf16_t* src, void* pool, long long slot, int head, int hk,
                             const float* scale, const float* signs, const float* channel,
                             WriteScratch& s) {
    const int lane = threadIdx.x & 31;
    const long long block = slot / KV_BLOCK;
    const int row = kv_row((int)(slot % KV_BLOCK), head);
    if constexpr (!W::kPacked) {
        store_elements<W, D>(src, pool, slot, head, hk, scale);
    } else {
        typedef PackedBlock<D, W::BITS, W::SB> Block;
        for (int i = lane; i < D; i += 32) s.y[i] = bf16_to_f32(src[i]);
        __syncwarp();
        if constexpr (W::kRotated) wht_rotate<D>(s.y, signs, signs + D);
        if (channel != nullptr) {
            for (int i = lane; i < D; i += 32) s.y[i] = __fmul_rn(s.y[i], channel[i]);
            __syncwarp();
        }
        for (int g0 = 0; g0 < Block::kGroups; g0 += 2) {  // two groups a pass (kGroups is even)
            const int g = g0 + (lane >> 4), e = g * KV_GROUP + (lane & 15);
            u8_t code;
            const unsigned int sb = W::group(s.y[e], code);
            s.codes[e] = code;
            if ((lane & 15) == 0) s.scales[g] = (unsigned short)sb;
        }
        __syncwarp();
        u8_t* base = static_cast<u8_t*>(pool);
        u8_t* data = base + Block::data(block, row, hk);
        for (int j = lane; j < Block::kDataBytes; j += 32) data[j] = pack_byte<W::BITS>(s.codes, j);
        u8_t* scales = base + Block::scales(block, row, hk);
        for (int j = lane; j < Block::kGroups * W::SB; j += 32) {
            scales[j] = (u8_t)(s.scales[j / W::SB] >> (8 * (j % W::SB)));
        }
        __syncwarp();
    }
}

// One CTA of 64 threads per (token, KV head): warp 0 stores K, warp 1 stores V.
// grid = (T, Hk). k_signs / v_signs / channel may be null where the side does not use them.
template <class KW, class VW>
__device__ void write_kv(const bf16_t* k, const bf16_t* v, void* k_cache, void* v_cache,
                         const int* slot_mapping, const float* k_scale, const float* v_scale,
                         const float* k_signs, const float* v_signs, const float* channel,
                         int hk, int head_dim) {
    __shared__ WriteScratch scratch[2];
    const long long t = blockIdx.x;
    const int head = blockIdx.y, warp = threadIdx.x >> 5;
    const int slot = slot_mapping[t];
    if (slot < 0 || warp > 1) return;
    const long long src = (t * hk + head) * head_dim;
#define METRALE_STORE(D)                                                                          \
    if (warp == 0)                                                                                \
        store_vector<KW, D>(k + src, k_cache, slot, head, hk, k_scale, k_signs, channel_row(channel, head, D), \
                            scratch[0]);                                                          \
    else                                                                                          \
        store_vector<VW, D>(v + src, v_cache, slot, head, hk, v_scale, v_signs, nullptr, scratch[1])
    switch (head_dim) {
        case 64: METRALE_STORE(64); break;
        case 128: METRALE_STORE(128); break;
        case 256: METRALE_STORE(256); break;
        case 512: METRALE_STORE(512); break;
    }
#undef METRALE_STORE
}
