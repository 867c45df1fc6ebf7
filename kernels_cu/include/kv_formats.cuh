// The byte formats of the KV-cache side types (docs/kv-formats.md is normative): packed-block
// geometry, the codebooks, and how one warp lane reads its D/32 consecutive elements of a cached
// vector. Writes live in kv_write.cuh.
//
// A side type is a template `side_<name><D>` (bf16, fp8, nvfp4, turbo2/3/4/8) with:
//   Raw                   the lane's undecoded bits, so a load can be in flight while the
//                         previous key is being scored
//   load(pool, block, row, num_kv_heads, lane) -> Raw    row = kv_row(slot_in_block, kv_head)
//   decode(raw, lut, f)   f[0 .. D/32) as fp32 values (times the per-tensor scale for fp8)
//   kLevels, level(code)  the code -> value table copied to shared memory (0 = no table)
//   kTensorScale          whether the (1,) per-tensor scale applies (fp8)
#pragma once
#include "numeric.cuh"

#define KV_BLOCK 16
#define KV_GROUP 16

// A block's 16 x Hk vectors are ordered [head][token] (docs/kv-formats.md, "Pools"): one head's
// 16 tokens lie together, so a decode CTA, which reads one KV head, streams whole spans of a block
// instead of one vector in every Hk.
__device__ __forceinline__ int kv_row(int token, int head) { return head * KV_BLOCK + token; }

// The pool-wide vector index of (slot, head): the block's first vector plus kv_row.
__device__ __forceinline__ long long kv_vector(long long slot, int head, int hk) {
    return slot / KV_BLOCK * KV_BLOCK * hk + kv_row((int)(slot % KV_BLOCK), head);
}

typedef unsigned char u8_t;

// Lloyd-Max levels of N(0, 1), positive halves, as the torch codecs build them (Python floats
// rounded to fp32); the full ascending table is the negated reversed half, then the half.
__constant__ float kTurbo4Half[8] = {(float)0.1284, (float)0.3880, (float)0.6568, (float)0.9423,
                                     (float)1.2562, (float)1.6180, (float)2.0690, (float)2.7326};
__constant__ float kTurbo3Half[4] = {(float)0.2451, (float)0.7560, (float)1.3440, (float)2.1520};
__constant__ float kTurbo2Half[2] = {(float)0.4528, (float)1.5104};
__constant__ float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

template <int BITS>
__device__ __forceinline__ float codebook_level(int code) {
    constexpr int HALF = 1 << (BITS - 1);
    const float* half = BITS == 4 ? kTurbo4Half : BITS == 3 ? kTurbo3Half : kTurbo2Half;
    return code < HALF ? -half[HALF - 1 - code] : half[code - HALF];
}

__device__ __forceinline__ float nvfp4_level(int code) {
    const float mag = kE2m1[code & 7];
    return (code & 8) ? -mag : mag;
}

__device__ __forceinline__ float e4m3_to_f32(unsigned int byte) {
    float lo, hi;
    e4m3x2_to_f32x2((unsigned short)(byte & 0xffu), lo, hi);
    return lo;
}

__device__ __forceinline__ unsigned int f32_to_e4m3(float x) {
    return f32x2_to_e4m3x2(x, 0.0f) & 0xffu;
}

// Geometry of a packed block: 16 x Hk vectors of DATA bytes ([head][token]), then their group
// scales ([head][token][group], SB bytes each). row: kv_row(token, head).
template <int D, int BITS, int SB>
struct PackedBlock {
    static constexpr int kDataBytes = D * BITS / 8;
    static constexpr int kGroups = D / KV_GROUP;
    static constexpr int kVectorBytes = kDataBytes + kGroups * SB;

    __device__ static long long base(long long block, int hk) {
        return block * KV_BLOCK * hk * kVectorBytes;
    }
    __device__ static long long data(long long block, int row, int hk) {
        return base(block, hk) + (long long)row * kDataBytes;
    }
    __device__ static long long scales(long long block, int row, int hk) {
        return base(block, hk) + (long long)KV_BLOCK * hk * kDataBytes + (long long)row * kGroups * SB;
    }
};

// NB bytes starting at p, little-endian. ALIGNED: p is a multiple of NB (1, 2, 4 or 8), so one
// load; else byte by byte.
template <int NB, bool ALIGNED>
__device__ __forceinline__ unsigned long long load_le(const u8_t* p) {
    if constexpr (ALIGNED && NB == 1) return *p;
    else if constexpr (ALIGNED && NB == 2) return *reinterpret_cast<const unsigned short*>(p);
    else if constexpr (ALIGNED && NB == 4) return *reinterpret_cast<const unsigned int*>(p);
    else if constexpr (ALIGNED && NB == 8) return *reinterpret_cast<const unsigned long long*>(p);
    else {
        unsigned long long v = 0;
#pragma unroll
        for (int b = 0; b < NB; ++b) v |= (unsigned long long)p[b] << (8 * b);
        return v;
    }
}

// ---- element sides: (NB, Hk, 16, D) tensors ---------------------------------------------------
template <int D, typename E, bool SCALED>
struct ElementSide {
    static constexpr int EPL = D / 32;
    static constexpr int kLevels = 0;
    static constexpr bool kTensorScale = SCALED;
    struct Raw {
        float f[EPL];
    };
    __device__ static float level(int) { return 0.0f; }
    __device__ static Raw load(const void* pool, long long block, int row, int hk, int lane) {
        Raw r;
        const long long off = (block * KV_BLOCK * hk + row) * D + lane * EPL;
        load_vec<EPL>(static_cast<const E*>(pool) + off, r.f);
        return r;
    }
    __device__ static void decode(const Raw& r, const float*, float* f) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) f[e] = r.f[e];
    }
};

template <int D>
using side_bf16 = ElementSide<D, bf16_t, false>;
template <int D>
using side_fp8 = ElementSide<D, fp8_t, true>;

// ---- packed code sides: nvfp4, turbo4/3/2 (a code per element, one e4m3 scale per group) -------
// Element i's code sits at bits [BITS*i, BITS*i + BITS) of the vector's data read as one
// little-endian bit stream (the 3-bit 24-bit words of the formats doc are exactly that).
template <int D, int BITS, bool NVFP4>
struct CodeSide {
    static constexpr int EPL = D / 32;
    static constexpr int kLevels = 1 << BITS;
    static constexpr bool kTensorScale = false;
    static constexpr int kLaneBits = EPL * BITS;
    typedef PackedBlock<D, BITS, 1> Block;
    struct Raw {
        unsigned long long bits;
        unsigned int scale;
    };
    __device__ static float level(int code) {
        if constexpr (NVFP4) return nvfp4_level(code);
        else return codebook_level<BITS>(code);
    }
    __device__ static Raw load(const void* pool, long long block, int row, int hk, int lane) {
        const u8_t* p = static_cast<const u8_t*>(pool);
        Raw r;
        const int first = lane * kLaneBits;
        const u8_t* data = p + Block::data(block, row, hk) + first / 8;
        if constexpr (kLaneBits % 8 == 0) {
            // lane * NB bytes into a vector whose data and block sizes are multiples of NB
            constexpr int NB = kLaneBits / 8;
            r.bits = load_le<NB, NB == 1 || NB == 2 || NB == 4 || NB == 8>(data);
        } else {
            // A lane's codes start mid-byte (D = 64 / 128 at 2 or 3 bits). The read may take a
            // byte past the vector; the scale region follows the data, so it stays in the block.
            r.bits = load_le<(kLaneBits + 7) / 8 + 1, false>(data) >> (first % 8);
        }
        r.scale = p[Block::scales(block, row, hk) + lane * EPL / KV_GROUP];
        return r;
    }
    __device__ static void decode(const Raw& r, const float* lut, float* f) {
        const float s = e4m3_to_f32(r.scale);
#pragma unroll
        for (int e = 0; e < EPL; ++e) f[e] = lut[(r.bits >> (e * BITS)) & (kLevels - 1)] * s;
    }
};

template <int D>
using side_nvfp4 = CodeSide<D, 4, true>;
template <int D>
using side_turbo4 = CodeSide<D, 4, false>;
template <int D>
using side_turbo3 = CodeSide<D, 3, false>;
template <int D>
using side_turbo2 = CodeSide<D, 2, false>;

// ---- turbo8: e4m3 bytes with a bf16 scale per group --------------------------------------------
template <int D>
struct side_turbo8 {
    static constexpr int EPL = D / 32;
    static constexpr int kLevels = 0;
    static constexpr bool kTensorScale = false;
    typedef PackedBlock<D, 8, 2> Block;
    struct Raw {
        float f[EPL];
        unsigned int scale;
    };
    __device__ static float level(int) { return 0.0f; }
    __device__ static Raw load(const void* pool, long long block, int row, int hk, int lane) {
        const u8_t* p = static_cast<const u8_t*>(pool);
        Raw r;
        load_vec<EPL>(reinterpret_cast<const fp8_t*>(p + Block::data(block, row, hk)) + lane * EPL, r.f);
        r.scale = *reinterpret_cast<const unsigned short*>(
            p + Block::scales(block, row, hk) + 2 * (lane * EPL / KV_GROUP));
        return r;
    }
    __device__ static void decode(const Raw& r, const float*, float* f) {
        const float s = bf16_to_f32((bf16_t)r.scale);
#pragma unroll
        for (int e = 0; e < EPL; ++e) f[e] = r.f[e] * s;
    }
};
