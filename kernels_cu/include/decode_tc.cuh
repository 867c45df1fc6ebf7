// The tensor-core paged decode body: paged_decode_tc.cu's kernels and decode_stack.cu's attention
// phase (see paged_decode_tc.cu for the scheme).
#pragma once
#include "mma.cuh"
#include "paged_attention.cuh"

#define TC_WARPS 4  // the standalone kernel's warps; decode_tc takes any count
#define TC_THREADS (TC_WARPS * 32)
#define TC_MAX_D 128  // the dims of a head one warp decodes: a longer head takes TC_MAX_D-dim parts of a warp each
// The longest head a module serves (its shared arrays' size): paged_decode_tc 128 (head_dim 64 and
// 128), paged_decode_tc_wide 256 (head_dim 256, two warps a tile).
#ifndef TC_HEAD_MAX
#define TC_HEAD_MAX TC_MAX_D
#endif
#define TC_ROWS 8  // query heads per CTA

// The warps that decode a tile of a D-dim head together (a unit): one up to TC_MAX_D dims, else one a part.
template <int D>
__device__ constexpr int tc_parts() { return D > TC_MAX_D ? D / TC_MAX_D : 1; }

// A barrier of the THREADS threads of unit `unit` (0 or 1): named barrier 1 + unit (0 is
// __syncthreads'), an immediate id so that the kernel holds 3 barriers, not all 16.
template <int THREADS>
__device__ __forceinline__ void tc_unit_sync(int unit) {
#ifdef METRALE_HOST_EMULATION
    emulated_named_sync(1 + unit, THREADS);
#else
    if (unit == 0) asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
    else asm volatile("bar.sync 2, %0;" ::"n"(THREADS) : "memory");
#endif
}

// The cache formats a side of the tensor-core decode reads (kv_formats.cuh's side types).
enum TcFormat { TC_BF16, TC_FP8, TC_NVFP4, TC_TURBO4, TC_TURBO3, TC_TURBO2, TC_TURBO8 };

template <int F>
struct TcFmt {
    // Packed: codes (or turbo8's e4m3 bytes) with a scale per group of 16; dequantized to bf16.
    static constexpr bool kPacked = F >= TC_NVFP4;
    // f16 MMAs (e4m3 and e2m1 times an e4m3 scale are exact in f16; a codebook level times its
    // e4m3 scale is rounded to f16 once); bf16 ones for bf16 and turbo8 (bf16 scales)
    static constexpr bool kF16 = F != TC_BF16 && F != TC_TURBO8;
    static constexpr int kBits = F == TC_BF16 ? 16
                                 : F == TC_FP8 || F == TC_TURBO8 ? 8
                                 : F == TC_TURBO3 ? 3
                                 : F == TC_TURBO2 ? 2
                                 : 4;
    static constexpr int kScaleBytes = F == TC_TURBO8 ? 2 : 1;  // a group's scale: bf16 or e4m3
};

// Cache elements per 16-byte load (element sides).
template <int F>
struct TcElems {
    static const int value = F == TC_FP8 ? 16 : 8;
};

// Element t of lane c's share of a K row (t < D / 4): the dim it stands for. Element sides: the
// 4 lanes of a key read 64 contiguous bytes a load; packed sides: lane c reads the c-th quarter.
template <int D, int F>
__device__ __forceinline__ int tc_dim(int c, int t) {
    if constexpr (TcFmt<F>::kPacked) {
        return c * (D / 4) + t;
    } else {
        constexpr int E = TcElems<F>::value;
        return (4 * (t / E) + c) * E + t % E;
    }
}

// The lane-share elements that register `hi` of q's B fragment for MMA step j pairs (lo in the
// low half; the A fragment's K registers pair the same elements): 4j + 2hi and the next one, or for
// nvfp4 (decoded a 32-bit word of eight codes at a time, tc_e2m1_word) 8w + p and 8w + p + 4 of
// word w = j / 2, p = 2 (j % 2) + hi.
template <int F>
__device__ __forceinline__ int tc_k_elem(int j, int hi, int half) {
    if constexpr (F == TC_NVFP4) return 8 * (j / 2) + 2 * (j % 2) + hi + 4 * half;
    else return 4 * j + 2 * hi + half;
}

template <bool F16>
__device__ __forceinline__ void tc_mma(float* d, const unsigned* a, const unsigned* b) {
    if constexpr (F16) mma_f16_16816(d, a, b);
    else mma_bf16_16816(d, a, b);
}

template <bool F16>
__device__ __forceinline__ unsigned tc_pack(float lo, float hi) {
    if constexpr (F16) return pack_f16x2(lo, hi);
    else return pack_bf16x2(lo, hi);
}

// The two halves of a packed pair, as rounded.
template <bool F16>
__device__ __forceinline__ void tc_unpack(unsigned v, float& lo, float& hi) {
    if constexpr (F16) unpack_f16x2(v, lo, hi);
    else unpack_bf16x2(v, lo, hi);
}

// NB bytes at offset `at` (a multiple of A) of a 4-byte aligned vector as little-endian words: the
// widest loads the alignment allows. Below 4-byte alignment (turbo3's 6-byte V slices at head_dim
// 128, its 3-byte ones at 64) the aligned words that hold the bytes (two at most there),
// funnel-shifted into place: the bytes past NB in the last word are the neighbouring slice's, which
// the decoders ignore (tc_word). A lane's slice offset does not change over its keys, so neither
// does the shift.
template <int NB, int A>
__device__ __forceinline__ void tc_load_bytes(const u8_t* vec, int at, unsigned* w) {
    constexpr int C = (A % 16 == 0 && NB % 16 == 0) ? 16
                      : (A % 8 == 0 && NB % 8 == 0) ? 8
                      : (A % 4 == 0 && NB % 4 == 0) ? 4
                      : 1;
    if constexpr (C >= 4) {
#pragma unroll
        for (int i = 0; i < NB / C; ++i) {
            const Words<C / 4> v = *reinterpret_cast<const Words<C / 4>*>(vec + at + i * C);
#pragma unroll
            for (int j = 0; j < C / 4; ++j) w[i * C / 4 + j] = v.w[j];
        }
    } else {
        constexpr int W = (4 - A % 4 + NB + 3) / 4;  // the aligned words NB bytes can straddle
        const unsigned* q = reinterpret_cast<const unsigned*>(vec + (at & ~3));
        const unsigned sh = 8u * static_cast<unsigned>(at & 3);
        unsigned r[W];
#pragma unroll
        for (int i = 0; i < W; ++i) r[i] = q[i];
#pragma unroll
        for (int i = 0; i < (NB + 3) / 4; ++i) w[i] = i + 1 < W ? __funnelshift_r(r[i], r[i + 1], sh) : r[i] >> sh;
    }
}

// S consecutive dims of one cached vector of a packed side, as loaded: their codes (the vector's
// bit stream, kv_formats.cuh) and the scales of the groups they lie in.
template <int F, int S>
struct TcSlice {
    static constexpr int kBytes = S * TcFmt<F>::kBits / 8;
    static constexpr int kGroups = S >= KV_GROUP ? S / KV_GROUP : 1;
    unsigned w[(kBytes + 3) / 4];
    unsigned scales;  // kGroups scales of kScaleBytes, little-endian
};

// Slice `idx` (dims S idx .. S idx + S) of the vector whose codes start at `data` and whose group
// scales start at `scales`.
// SCALES false: the codes only, `scales` left for the caller (TcLoader's scale word).
template <int D, int F, int S, bool SCALES = true>
__device__ __forceinline__ TcSlice<F, S> tc_load_slice(const u8_t* data, const u8_t* scales, int idx) {
    typedef TcFmt<F> Fmt;
    typedef PackedBlock<D, Fmt::kBits, Fmt::kScaleBytes> Block;
    typedef TcSlice<F, S> Slice;
    constexpr int A = (Block::kDataBytes | Slice::kBytes) & -(Block::kDataBytes | Slice::kBytes);  // lowest set bit
    TcSlice<F, S> s;
    static_assert(Block::kDataBytes % 4 == 0, "a vector's codes start 4-byte aligned");
    tc_load_bytes<Slice::kBytes, A>(data, idx * Slice::kBytes, s.w);
    constexpr int SB = Slice::kGroups * Fmt::kScaleBytes;
    if constexpr (SCALES) s.scales = (unsigned)load_le<SB, true>(scales + idx * S / KV_GROUP * Fmt::kScaleBytes);
    return s;
}

// turbo8's elements 2i, 2i + 1 of a slice as bf16x2: e4m3 times the group's bf16 scale, rounded once.
template <int F, int S>
__device__ __forceinline__ unsigned tc_pair(const TcSlice<F, S>& s, int i) {
    const int grp = S >= KV_GROUP ? 2 * i / KV_GROUP : 0;
    const float scale = bf16_to_f32((bf16_t)(s.scales >> (16 * grp)));
    float lo, hi;
    const unsigned w = s.w[i / 2];
    unpack_f16x2(i % 2 ? e4m3x4_hi_to_f16x2(w) : e4m3x4_lo_to_f16x2(w), lo, hi);  // exact
    return pack_bf16x2(lo * scale, hi * scale);
}

// A codebook side's levels as f16, high and low bytes apart, for byte-permute lookups of four codes
// at once (no shared memory): turbo4 its eight magnitudes (the sign apart), turbo3 / turbo2 their
// 8 / 4 signed levels.
struct TcCodes {
    unsigned hi[2], lo[2];  // entries 0-3, 4-7
};

template <int F>
__device__ __forceinline__ TcCodes tc_codes() {
    TcCodes t{{0u, 0u}, {0u, 0u}};
    constexpr int N = F == TC_TURBO2 ? 4 : 8;
    if constexpr (TcFmt<F>::kPacked && F != TC_TURBO8 && F != TC_NVFP4) {
#pragma unroll
        for (int m = 0; m < N; ++m) {
            const float level = F == TC_TURBO4 ? kTurbo4Half[m] : codebook_level<TcFmt<F>::kBits>(m);
            const unsigned b = pack_f16x2(level, 0.0f) & 0xffffu;
            t.hi[m / 4] |= (b >> 8) << (8 * (m % 4));
            t.lo[m / 4] |= (b & 0xffu) << (8 * (m % 4));
        }
    }
    return t;
}

// nvfp4's codes are placed as f16 bits with no table: an e2m1 code's sign at bit 15 and its three
// magnitude bits (two exponent bits, one mantissa bit) at bits 11 .. 9 make the f16 2^-14 times its
// value, exactly (code 1, 0.5, the subnormal 2^-15; codes 2 .. 7 normal). Times an e4m3 scale the
// product stays exact: a multiple of 2^-24 (f16's subnormal step) below 0.17. The decode takes the
// 2^14 back on the fp32 side, in q's multiplier (K) and the output's scale (V), powers of two. The
// host emulation's sums give the same bits as with the values themselves; an H200's MMA sums do
// not quite (a few bf16 outputs a rounding step apart), inside the attention tolerance.
#define TC_E2M1_UNIT 16384.0f  // 2^14

// The high word of a * b; with b = 2^(32 - K), a >> K. On the FMA pipe (IMAD.HI) where a shift or a
// logic op would take the ALU pipe, the one that bounds the packed decodes (permutes, logic ops
// and shifts are most of their instructions). Used by turbo4's index only: there it made the
// decode 3% faster on an H200, where nvfp4's word (tc_e2m1_word) with it measured 11% slower and
// turbo3's 2% (an IMAD's longer latency on a dependent chain).
__device__ __forceinline__ unsigned tc_mulhi(unsigned a, unsigned b) {
#ifdef METRALE_HOST_EMULATION
    return (unsigned)(((unsigned long long)a * b) >> 32);
#else
    return __umulhi(a, b);
#endif
}
template <int K>
__device__ __forceinline__ unsigned tc_shr(unsigned x) {
    static_assert(K > 0 && K < 32, "a shift by 1 .. 31");
    return tc_mulhi(x, 1u << (32 - K));
}

// The bits of a where K is set, of b elsewhere: one LOP3. Written as inline PTX because the
// compiler's own form of (a & K) | (b & ~K) masks b first, two instructions.
template <unsigned K>
__device__ __forceinline__ unsigned tc_select(unsigned a, unsigned b) {
#ifdef METRALE_HOST_EMULATION
    return (a & K) | (b & ~K);
#else
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xca;" : "=r"(d) : "n"(K), "r"(a), "r"(b));  // k ? a : b
    return d;
#endif
}

// Eight nvfp4 codes (a 32-bit word of a slice, code i at bits 4i .. 4i + 3; or a pair word, two
// keys' codes 0-3 or 4-7 in its halves) times their group's scale (f16x2, the scale twice) as four
// f16x2 words, h[p] = codes p (low half) and p + 4 (high), each 2^-14 times the value. The even
// codes' magnitudes go to bits 1-3 of a byte each and their signs to bit 7 (e), the odd codes' the
// same (o), each one select of two shifts of x, or of one shift and x (the other bits are the
// shifts' leftovers). Bytes 1 and 3 of e or o then hold two codes at bits 9-11 and 15 of the halves
// already, and a shift by 8 brings bytes 0 and 2 there; one mask clears the rest. Five shifts and
// six logic ops a word (seven and six when the bytes held bits 0-2 and 6: every word then shifted).
__device__ __forceinline__ void tc_e2m1_word(unsigned x, unsigned scale2, unsigned (&h)[4]) {
    const unsigned e = tc_select<0x0e0e0e0eu>(x << 1, x << 4), o = tc_select<0x0e0e0e0eu>(x >> 3, x);
    h[0] = mul_f16x2((e << 8) & 0x8e008e00u, scale2);  // codes 0, 4: bytes 0, 2 of e
    h[1] = mul_f16x2((o << 8) & 0x8e008e00u, scale2);  // codes 1, 5: bytes 0, 2 of o
    h[2] = mul_f16x2(e & 0x8e008e00u, scale2);         // codes 2, 6: bytes 1, 3 of e
    h[3] = mul_f16x2(o & 0x8e008e00u, scale2);         // codes 3, 7: bytes 1, 3 of o
}

// The same for two keys' words x, y at once (V's registers pair one dim of two keys):
// lo[p] = (x's code p, y's code p), hi[p] = (x's code p + 4, y's), times (x's scale, y's) in scales.
__device__ __forceinline__ void tc_e2m1_pair(unsigned x, unsigned y, unsigned scales, unsigned (&lo)[4],
                                             unsigned (&hi)[4]) {
    const unsigned sl = prmt(x, y, 0x5410u), sh = prmt(x, y, 0x7632u);  // codes 0-3 (4-7) of x low, of y high
    tc_e2m1_word(sl, scales, lo);
    tc_e2m1_word(sh, scales, hi);
}

// Two e4m3 scale bytes (bits 0-7: the low half, 8-15: the high half) as f16x2, exact.
__device__ __forceinline__ unsigned tc_e4m3_f16x2(unsigned b) { return e4m3x4_lo_to_f16x2(b & 0xffffu); }

// turbo8's elements 4q .. 4q + 3 of a slice as two bf16x2 words (w0: 4q, 4q + 1).
template <int S>
__device__ __forceinline__ void tc_quad(const TcSlice<TC_TURBO8, S>& s, int q, unsigned& w0, unsigned& w1) {
    w0 = tc_pair(s, 2 * q);
    w1 = tc_pair(s, 2 * q + 1);
}

// Bytes I and J (0-7) of (y:x), e4m3 values, as a bf16x2 word (I low) of 2^-120 times each value,
// exactly: byte b's exponent and mantissa (bits 0-6) go to bits 4-10, where a bf16 with a zero
// high exponent nibble holds them, its sign to bit 15 (a sign-replicated byte's, shifted). Normal
// and subnormal e4m3 alike; an e4m3 NaN code (only a NaN input writes one) reads as 480 x 2^-120.
template <int I, int J>
__device__ __forceinline__ unsigned tc_e4m3_bf16(unsigned x, unsigned y) {
    return (prmt(x, y, I | (I | 8) << 4 | J << 8 | (J | 8) << 12) << 4) & 0x87f087f0u;
}

// turbo8 V: two keys' bf16 scales (bits 0-15 of a and b) times 2^120, as the bf16x2 word (a low)
// that turns tc_e4m3_bf16's words into the elements, rounded once (mul_bf16x2): the bits of
// tc_pair's. Exact below 256; `top` keeps the larger scale's bits for the caller's guard (a scale
// of 256 or more, or not finite, has no such factor).
__device__ __forceinline__ unsigned tc_turbo8_factor(unsigned a, unsigned b, unsigned& top) {
    a &= 0xffffu;
    b &= 0xffffu;
    top = max(top, max(a, b));
    const float fa = __uint_as_float(a << 16) * 0x1p120f, fb = __uint_as_float(b << 16) * 0x1p120f;
    return prmt(__float_as_uint(fa), __float_as_uint(fb), 0x7632u);
}
// The largest bf16 scale tc_turbo8_factor serves: 255.0 (0 sends every tile with a nonzero scale
// the fp32 way: the tests' bit-for-bit reference build).
#ifndef TC_TURBO8_FACTOR_MAX
#define TC_TURBO8_FACTOR_MAX 0x437fu
#endif

// A codebook side's (turbo4, turbo3, turbo2) eight codes as table indices, in the nibbles of idx
// (code i at bits B i of the word, bits above 8B ignored). turbo4's index a magnitude, as its
// negative levels mirror the positive ones below code 8 (index 7 - c there); bit 7 of byte i of
// pos[h] is set where code 4h + i is not below zero.
template <int F>
struct TcIndex {
    unsigned idx, pos[2];
};
template <int F>
__device__ __forceinline__ TcIndex<F> tc_code_index(unsigned x) {
    constexpr int B = TcFmt<F>::kBits;
    TcIndex<F> r{0u, {0u, 0u}};
    if constexpr (F == TC_TURBO4) {
        r.idx = (x ^ tc_mulhi(~x & 0x88888888u, 7u << 29)) & 0x77777777u;  // 7 in a nibble whose bit 3 is clear
        // code i's sign bit (bit 4i + 3) is bit 7 of a byte of x for odd i, of x << 4 for even i
        const unsigned y = x << 4;
        r.pos[0] = prmt(y, x, 0x5140u);
        r.pos[1] = prmt(y, x, 0x7362u);
    } else if constexpr (B == 3) {  // codes at bits 3i -> 4i
        const unsigned y = tc_select<0x00000fffu>(x, x << 4);  // codes 0-3 at bits 0-11, 4-7 at 16-27
        const unsigned z = tc_select<0x003f003fu>(y, y << 2);  // pairs at bits 0, 8, 16, 24
        r.idx = (z & 0x07070707u) | ((z << 1) & 0x70707070u);
    } else {  // 2 bits: 2i -> 4i
        const unsigned y = tc_select<0x000000ffu>(x, x << 8);  // codes 0-3 at bits 0-7, 4-7 at 16-23
        const unsigned z = tc_select<0x000f000fu>(y, y << 4);  // pairs at bits 0, 8, 16, 24
        r.idx = (z & 0x03030303u) | ((z << 2) & 0x30303030u);
    }
    return r;
}

// The levels of eight indexed codes times scale2 (f16x2), each rounded to f16 once, as four f16x2
// words: per four codes (nibbles 4 half .. 4 half + 3) two table permutes (the levels' low and high
// bytes), turbo4's signs or-ed into the high bytes (the table's are clear), and two byte interleaves
// (selectors S0, S1: 0x5140 / 0x7362 pair codes 0, 1 and 2, 3 of the four; 0x6240 / 0x7351 pair 0, 2
// and 1, 3), one f16 multiply a word.
template <int F, unsigned S0, unsigned S1>
__device__ __forceinline__ void tc_code_levels(const TcIndex<F>& c, const TcCodes& t, unsigned scale2, unsigned (&h)[4]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        // (turbo4's on the FMA pipe; the others measured faster with the shift)
        const unsigned i4 = F == TC_TURBO4 && half ? tc_shr<16>(c.idx) : c.idx >> (16 * half);
        const unsigned lo = prmt(t.lo[0], t.lo[1], i4);
        unsigned hi = prmt(t.hi[0], t.hi[1], i4);
        if constexpr (F == TC_TURBO4) hi |= ~c.pos[half] & 0x80808080u;
        h[2 * half] = mul_f16x2(prmt(lo, hi, S0), scale2);
        h[2 * half + 1] = mul_f16x2(prmt(lo, hi, S1), scale2);
    }
}

// Eight codes of a codebook side times their group's scale (scale2: the scale twice) as four f16x2
// words, h[i] = codes 2i (low half) and 2i + 1.
template <int F>
__device__ __forceinline__ void tc_code_word(unsigned x, const TcCodes& t, unsigned scale2, unsigned (&h)[4]) {
    tc_code_levels<F, 0x5140u, 0x7362u>(tc_code_index<F>(x), t, scale2, h);
}

// The same codes of two keys (x, y; scales: x's scale low, y's high) as eight f16x2 words, p[j] = code j
// of x (low half) and of y: the A operand's pairing of V^T. The two keys' codes are interleaved a
// byte (two codes) at a time before the lookups: turbo4's raw codes, the other sides' indices.
template <int F>
__device__ __forceinline__ void tc_code_pair(unsigned x, unsigned y, const TcCodes& t, unsigned scales, unsigned (&p)[8]) {
    TcIndex<F> c0{}, c1{};  // codes x 0, 1, y 0, 1, x 2, 3, y 2, 3 (c0); x 4, 5, y 4, 5, x 6, 7, y 6, 7 (c1)
    if constexpr (F == TC_TURBO4) {
        c0 = tc_code_index<F>(prmt(x, y, 0x5140u));
        c1 = tc_code_index<F>(prmt(x, y, 0x7362u));
    } else {
        const unsigned ix = tc_code_index<F>(x).idx, iy = tc_code_index<F>(y).idx;
        c0.idx = prmt(ix, iy, 0x5140u);
        c1.idx = prmt(ix, iy, 0x7362u);
    }
    unsigned h0[4], h1[4];
    tc_code_levels<F, 0x6240u, 0x7351u>(c0, t, scales, h0);
    tc_code_levels<F, 0x6240u, 0x7351u>(c1, t, scales, h1);
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = h0[j], p[4 + j] = h1[j];
}

// A packed slice's codes 8x .. 8x + 7 (the bits of a B-bit side's codes from bit 8 B x).
template <int F, int S>
__device__ __forceinline__ unsigned tc_code_bits(const TcSlice<F, S>& s, int x) {
    constexpr int B = TcFmt<F>::kBits;
    const int bit = 8 * B * x, word = bit / 32, sh = bit % 32;
    unsigned v = s.w[word] >> sh;
    if (sh + 8 * B > 32) v |= s.w[word + 1] << (32 - sh);
    return v;
}

// The same codes and their group's e4m3 scale byte.
template <int F, int S>
__device__ __forceinline__ unsigned tc_bits(const TcSlice<F, S>& s, int x, unsigned& scale) {
    const int grp = S >= KV_GROUP ? 8 * x / KV_GROUP : 0;
    scale = (s.scales >> (8 * grp)) & 0xffu;
    return tc_code_bits(s, x);
}

// Codes 8x .. 8x + 7 of a slice as four f16x2 words times their group's scale: nvfp4's h[p] hold
// codes 8x + p and 8x + p + 4 (tc_e2m1_word), a codebook side's h[i] codes 8x + 2i and 8x + 2i + 1.
template <int F, int S>
__device__ __forceinline__ void tc_word(const TcSlice<F, S>& s, int x, const TcCodes& t, unsigned (&h)[4]) {
    unsigned scale;
    const unsigned v = tc_bits(s, x, scale);
    const unsigned scale2 = tc_e4m3_f16x2(scale * 0x101u);
    if constexpr (F == TC_NVFP4) tc_e2m1_word(v, scale2, h);
    else tc_code_word<F>(v, t, scale2, h);
}

// A lane's share of one key's K (NC 16-byte chunks, or a packed side's quarter slice) and V
// (D / 8 dims: words, or a packed side's slice), as loaded.
template <int D, int F, bool PACKED = TcFmt<F>::kPacked>
struct TcRows {
    struct K {
        Words<4> c[D / (4 * TcElems<F>::value)];
    };
    typedef Words<D / 8 * (F == TC_FP8 ? 1 : 2) / 4> V;
};
template <int D, int F>
struct TcRows<D, F, true> {
    typedef TcSlice<F, D / 4> K;
    typedef TcSlice<F, D / 8> V;
};

struct TcWork {
    const bf16_t* q;  // the CTA's first query head (global or shared memory)
    const unsigned char* k_cache;
    const unsigned char* v_cache;
    const int* block_table;  // this sequence's row
    long long head0;         // the CTA's first query head (b * Hq + ...)
    int rows;                // its query heads: up to TC_ROWS
    int num_kv_heads, kv_head, begin, end, num_splits, split;
    float qk_scale, v_scale;
    bf16_t* out;
    float* part_o;  // null: write the final output
    float* part_ml;
    float* smem_o;   // [WARPS][TC_ROWS][TC_MAX_D]: a unit's [TC_ROWS][max(D, TC_MAX_D)]
    float* smem_ml;  // [WARPS][TC_ROWS][2]
    float* keep_o = nullptr;   // [TC_ROWS][D] in shared memory: the split's partial kept there (a
    float* keep_ml = nullptr;  // cluster's combine reads it) instead of part_o / part_ml; [TC_ROWS][2]
};

// The tile key of this lane's V word set v (0-3): keys 2c, 2c + 1, 8 + 2c, 9 + 2c.
__device__ __forceinline__ int tc_v_key(int c, int v) { return 2 * c + (v & 1) + 8 * (v >> 1); }

// The dim of O^T row 8r + g of output tile n: lane group g holds dims D/8 g .. D/8 g + D/8 of V,
// tile n pairs dims 2n (row g) and 2n + 1 (row g + 8) of them; nvfp4's tile 4w + p dims 8w + p
// and 8w + p + 4 (tc_e2m1_pair's order).
template <int D, int VF>
__device__ __forceinline__ int tc_out_dim(int n, int r, int g) {
    if constexpr (VF == TC_NVFP4) return D / 8 * g + 8 * (n / 4) + n % 4 + 4 * r;
    else return D / 8 * g + 2 * n + r;
}

// A warp's tile of K and V as its lanes hold them: keys g, g + 8 of K and tc_v_key(c, 0..3) of V.
template <int D, int KF, int VF>
struct TcTile {
    static constexpr int DW = D / tc_parts<D>();
    typename TcRows<DW, KF>::K k[2];
    typename TcRows<DW, VF>::V v[4];
};

// Whether a packed V side's group scales come as one word a lane: lane L loads bytes 8 part +
// 4 (L % 2) .. + 3 of key L / 2's scales (a warp's 128 bytes: the part's 8 groups of the tile's 16
// keys), and each key's byte is then taken from the lane that holds it by a shuffle (tc_v_scales),
// where otherwise a lane loads its four keys' bytes one by one and keeps them to the next tile:
// three registers fewer each for the tile in flight and the one decoded, four shuffles more a
// tile. Served where a warp takes 128 dims (head_dim 128, or 256 in two parts) of a side with
// one-byte scales, one tile a pass; taken by the rule for turbo4k_turbo3v at 128, whose 16 bytes
// of spill it removes and which an H100 measured 1.5-3% faster (docs/performance.md). fp8k_turbo3v
// (24 bytes of spill, 16 left) measured no faster there, bf16k_turbo3v and turbo2 slower.
// TC_V_SCALE_WORD (a build variant for measurements, tools/batch_decode.py): 0 none, 2 every entry
// it serves.
template <int D, int KF, int VF, bool PAIR>
__device__ constexpr bool tc_v_scale_word() {
    constexpr bool served = !PAIR && D / tc_parts<D>() == 128 && TcFmt<VF>::kPacked && VF != TC_TURBO8 &&
                            TcFmt<VF>::kScaleBytes == 1 && KV_GROUP == 16;
#ifdef TC_V_SCALE_WORD
    if constexpr (TC_V_SCALE_WORD != 1) return served && TC_V_SCALE_WORD == 2;
#endif
    return served && D == 128 && KF == TC_TURBO4 && VF == TC_TURBO3;
}

// The scale words that hold the four V keys' bytes of lane (g, c) (keys tc_v_key(c, 0..3), its
// slice's group g of the part's eight), from the warp's words (tc_v_scale_word): key x's byte is
// byte g % 4 of v[x].scales, which tc_v_scale_pair takes.
template <int F, int S>
__device__ __forceinline__ void tc_v_scales(TcSlice<F, S> (&v)[4], int g, int c) {
    const unsigned word = v[0].scales;
    const int src = 2 * tc_v_key(c, 0) + g / 4;  // 4c + g / 4: bits 1 and 4 clear, so key x's lane is src | 2 tc_v_key(0, x)
#pragma unroll
    for (int x = 0; x < 4; ++x)
        v[x].scales = static_cast<unsigned>(__shfl_sync(0xffffffffu, static_cast<int>(word), src | 2 * tc_v_key(0, x)));
}

// Two V keys' scale bytes for their slices' group (a slice within one group): a's in bits 0-7, b's
// in 8-15, as the words hold them (VSW: byte g % 4 of each, tc_v_scales) or as loaded.
template <bool VSW, int F, int S>
__device__ __forceinline__ unsigned tc_v_scale_pair(const TcSlice<F, S>& a, const TcSlice<F, S>& b, int g) {
    static_assert(S <= KV_GROUP, "a slice within one group");
    if constexpr (VSW) return prmt(a.scales, b.scales, 0x40u + 0x11u * static_cast<unsigned>(g & 3));
    else return (a.scales & 0xffu) | (b.scales & 0xffu) << 8;
}

// A lane's loads of a tile's K and V (a dead key's slot is still inside the block: its scores are
// masked, its V zeroed by the decode; with PAIR zeroed here, as is a tile past the end, whose block
// is not read). Each side loads from per-lane pointers at block 0, a tile's block added by one
// multiply-add: the lane's first key's codes and scales (or elements); its other keys lie a
// compile-time number of rows on (a block's rows are head-major). For the packed sides 11-38 fewer
// instructions a tile than addresses rebuilt from the block and row, 1-4% faster on an H200.
template <int D, int KF, int VF, bool PAIR = false>
struct TcLoader {
    static constexpr int PARTS = tc_parts<D>(), DW = D / PARTS;
    typedef TcFmt<KF> KFmt;
    typedef TcFmt<VF> VFmt;
    typedef typename TcRows<DW, KF>::K KRow;
    typedef typename TcRows<DW, VF>::V VRow;
    typedef PackedBlock<D, KFmt::kBits, KFmt::kScaleBytes> KBlock;
    typedef PackedBlock<D, VFmt::kBits, VFmt::kScaleBytes> VBlock;
    static constexpr int KB = KF == TC_FP8 ? 1 : 2, VB = VF == TC_FP8 ? 1 : 2;  // element sides' bytes
    static constexpr int NC = DW / (4 * TcElems<KF>::value);  // 16-byte chunks of a key row per lane
    static constexpr int VW = DW / 8 * VB / 4;  // V words per key of a lane (element V sides)
    static constexpr int KROW = KFmt::kPacked ? KBlock::kDataBytes : D * KB;  // a K row's bytes to the next row's
    static constexpr int VROW = VFmt::kPacked ? VBlock::kDataBytes : D * VB;
    static constexpr bool U32 = KFmt::kPacked || VFmt::kPacked;
    static constexpr bool VSW = tc_v_scale_word<D, KF, VF, PAIR>();
    const int* block_table;
    int end, part, c, g;
    unsigned k_block_bytes, v_block_bytes;
    const u8_t *kd0, *ks0, *vd0, *vs0;

    // The caches and block table of TcWork's fields, the tiles before `end` live.
    __device__ __forceinline__ TcLoader(const u8_t* k_cache, const u8_t* v_cache, const int* table, int num_kv_heads,
                                        int kv_head, int end_)
        : block_table(table),
          end(end_),
          part((threadIdx.x >> 5) % PARTS),
          c(threadIdx.x & 3),
          g((threadIdx.x & 31) >> 2),
          k_block_bytes(ATTN_BLOCK * num_kv_heads * (KFmt::kPacked ? KBlock::kVectorBytes : D * KB)),
          v_block_bytes(ATTN_BLOCK * num_kv_heads * (VFmt::kPacked ? VBlock::kVectorBytes : D * VB)) {
        const int d0 = part * DW;
        const int k_row0 = kv_row(g, kv_head), v_row0 = kv_row(tc_v_key(c, 0), kv_head);
        kd0 = k_cache + (KFmt::kPacked ? KBlock::data(0, k_row0, num_kv_heads)
                                       : (long long)k_row0 * KROW + d0 * KB + c * 16);
        ks0 = k_cache + KBlock::scales(0, k_row0, num_kv_heads);
        vd0 = v_cache + (VFmt::kPacked ? VBlock::data(0, v_row0, num_kv_heads)
                                       : (long long)v_row0 * VROW + d0 * VB + g * (VW * 4));
        vs0 = v_cache + (VSW ? VBlock::scales(0, kv_row((threadIdx.x & 31) >> 1, kv_head), num_kv_heads) + 8 * part +
                                   4 * (threadIdx.x & 1)
                             : VBlock::scales(0, v_row0, num_kv_heads));  // VSW: the lane's scale word
    }
    __device__ __forceinline__ explicit TcLoader(const TcWork& w)
        : TcLoader(w.k_cache, w.v_cache, w.block_table, w.num_kv_heads, w.kv_head, w.end) {}

    __device__ __forceinline__ void operator()(int tile, TcTile<D, KF, VF>& t) const { (*this)(tile, t.k, t.v); }

    __device__ __forceinline__ void operator()(int tile, KRow (&k)[2], VRow (&v)[4]) const {
        const bool live = !PAIR || tile < end;
        // The packed entries take the block as unsigned, each pointer one 32 x 32 -> 64-bit
        // multiply-add (fp8k_turbo3v's decode 2.3% faster on an H200 than with signed 64-bit
        // products); bf16 and fp8 keep the signed products, with which bf16 measured 1.2% faster.
        const u8_t *kd, *ks, *vd, *vs;
        if constexpr (U32) {
            const unsigned block = live ? (unsigned)block_table[(unsigned)tile / ATTN_BLOCK] : 0u;
            kd = kd0 + (unsigned long long)block * k_block_bytes;
            ks = ks0 + (unsigned long long)block * k_block_bytes;
            vd = vd0 + (unsigned long long)block * v_block_bytes;
            vs = vs0 + (unsigned long long)block * v_block_bytes;
        } else {
            const long long block = live ? block_table[tile / ATTN_BLOCK] : 0;
            kd = kd0 + block * (int)k_block_bytes;
            ks = ks0 + block * (int)k_block_bytes;
            vd = vd0 + block * (int)v_block_bytes;
            vs = vs0 + block * (int)v_block_bytes;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // K: keys g, g + 8
            if (!live) {
                k[h] = KRow{};
            } else if constexpr (KFmt::kPacked) {  // quarter c of the part's dims
                k[h] = tc_load_slice<D, KF, DW / 4>(kd + 8 * h * KROW,
                                                    ks + 8 * h * KBlock::kGroups * KFmt::kScaleBytes, 4 * part + c);
            } else {
                const unsigned char* kp = kd + 8 * h * KROW;
#pragma unroll
                for (int i = 0; i < NC; ++i) k[h].c[i] = *reinterpret_cast<const Words<4>*>(kp + 64 * i);
            }
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {  // V: keys tc_v_key(c, x), dims d0 + DW/8 g .. d0 + DW/8 g + DW/8
            const int dr = (x & 1) + 8 * (x >> 1);  // tc_v_key(c, x) - tc_v_key(c, 0)
            if (PAIR && tile + tc_v_key(c, x) >= end) {
                v[x] = VRow{};
            } else if constexpr (VSW) {
                v[x] = tc_load_slice<D, VF, DW / 8, false>(vd + dr * VROW, nullptr, 8 * part + g);
                if (x == 0) v[0].scales = *reinterpret_cast<const unsigned*>(vs);
            } else if constexpr (VFmt::kPacked) {
                v[x] = tc_load_slice<D, VF, DW / 8>(vd + dr * VROW, vs + dr * VBlock::kGroups * VFmt::kScaleBytes,
                                                    8 * part + g);
            } else {
                v[x] = *reinterpret_cast<const VRow*>(vd + dr * VROW);
            }
        }
    }
};

// Whether the prefetching loop keeps its two tile buffers in turns, two tiles a pass, rather than
// copying the next tile's registers over the current one's after each tile. In turns saves the
// copies (20 to 25 instructions a tile) but unrolls the loop twice over and lets the register
// allocation change, so it is taken where an H200 measured it faster (docs/performance.md): the
// 128-dim nvfp4, turbo4 and fp8k_turbo2v decodes and the 256-dim nvfp4 and turbo3 ones. fp8,
// fp8k_turbo3v, turbo3 and turbo4k_turbo3v at 128 measured slower. TC_TURNS_ALL (a build variant
// for measurements, tools/batch_decode.py): 1 every prefetching entry in turns, 0 none.
template <int D, int KF, int VF>
__device__ constexpr bool tc_turns() {
#ifdef TC_TURNS_ALL
    return TC_TURNS_ALL != 0;
#else
    if constexpr (D == 128) {
        return (KF == VF && (KF == TC_NVFP4 || KF == TC_TURBO4)) || (KF == TC_FP8 && VF == TC_TURBO2);
    } else if constexpr (D == 256) {
        return KF == VF && (KF == TC_NVFP4 || KF == TC_TURBO3);
    } else {
        return false;
    }
#endif
}

// Run by all WARPS warps of the CTA (one CTA_SYNC inside). KF / VF: the
// K and V sides' formats (TcFormat). A head of more than TC_MAX_D dims (256) is decoded by units of
// PARTS warps: each warp of a unit takes the unit's tiles over its DW dims (part p: dims DW p ..
// DW p + DW of q, K, V and the output), the unit's warps add their partial scores through shared
// memory (a named barrier a tile), and each runs the same online softmax on the sums.
// `first`: the warp's first tile as the caller loaded it (TcLoader), or null: decode_tc loads it
// (not with PAIR).
template <int D, int KF, int VF, int WARPS = TC_WARPS, bool PAIR_ASKED = false>
__device__ void decode_tc(const TcWork& w, const TcTile<D, KF, VF>* first = nullptr) {
    constexpr int PARTS = tc_parts<D>(), DW = D / PARTS, UNITS = WARPS / PARTS;
    constexpr int ROWD = D > TC_MAX_D ? D : TC_MAX_D;  // a head's row in a unit's smem_o
    static_assert(DW <= TC_MAX_D && WARPS % PARTS == 0 && (PARTS == 1 || UNITS <= 2), "a head's parts fit a warp each; 1 or 2 units of them");
    typedef TcFmt<KF> KFmt;
    typedef TcFmt<VF> VFmt;
    typedef typename TcRows<DW, KF>::K KRow;
    typedef typename TcRows<DW, VF>::V VRow;
    constexpr int KS = DW / 16;       // MMA steps over the part's dims (S^T) and output tiles (O^T)
    constexpr bool KF16 = KFmt::kF16, VF16 = VFmt::kF16;
    // A warp's next tile is loaded before this one is scored where the registers allow it (an fp8
    // or packed tile holds too few bytes to keep enough in flight otherwise); bf16 K has none to spare.
    constexpr bool PREFETCH = KF != TC_BF16;
    // PAIR_ASKED: two tiles a pass where the next tile is prefetched and a warp holds a whole head
    // (twice the loaded tiles' registers: the batch-1 entries, which have them to spare).
    constexpr bool PAIR = PAIR_ASKED && PREFETCH && PARTS == 1;
    constexpr bool TURNS = !PAIR && PREFETCH && tc_turns<D, KF, VF>();
    constexpr int VW = TcLoader<D, KF, VF>::VW;  // V words per key of a lane (element V sides): DW / 8 dims
    constexpr bool VSW = TcLoader<D, KF, VF, PAIR>::VSW;  // V's scales a word a lane
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int part = warp % PARTS, unit = warp / PARTS, d0 = part * DW;  // the warp's first dim

    const TcCodes kcodes = tc_codes<KF>(), vcodes = tc_codes<VF>();

    // q as the B operand of S^T = K Q^T: head g, elements 4j, 4j + 1 (register 0) and 4j + 2,
    // 4j + 3 (register 1) of this lane's share; zero past the CTA's heads.
    const bool has = g < w.rows;
    const bf16_t* qr = w.q + g * D;
    float q_mul = w.qk_scale * LOG2E * (KF == TC_NVFP4 ? TC_E2M1_UNIT : 1.0f), q_scale = 1.0f;
    if constexpr (KF16) {
        float amax = 0.0f;
        if (has) {  // over every part's dims: the unit's warps scale q alike
#pragma unroll
            for (int p = 0; p < PARTS; ++p)
#pragma unroll
                for (int e = 0; e < DW / 4; ++e)
                    amax = fmaxf(amax, fabsf(bf16_to_f32(qr[p * DW + tc_dim<DW, KF>(c, e)])));
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        // amax < 2^(x + 1); q * 2^-e stays below 2^15, inside f16's range.
        const int x = (int)((__float_as_uint(amax) >> 23) & 0xffu) - 127;
        const int e = max(0, x - 14);
        q_scale = __uint_as_float((unsigned)(127 - e) << 23);
        q_mul *= __uint_as_float((unsigned)(127 + e) << 23);
    }
    unsigned qb[KS][2];
#pragma unroll
    for (int j = 0; j < KS; ++j) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const int e0 = d0 + tc_dim<DW, KF>(c, tc_k_elem<KF>(j, hi, 0));
            const int e1 = d0 + tc_dim<DW, KF>(c, tc_k_elem<KF>(j, hi, 1));
            qb[j][hi] = tc_pack<KF16>(has ? bf16_to_f32(qr[e0]) * q_scale : 0.0f,
                                      has ? bf16_to_f32(qr[e1]) * q_scale : 0.0f);
        }
    }

    // This lane's heads 2c + e (e = 0, 1): running max, sum (over its keys g, g + 8 only; the 8
    // lanes of a head add up at the end) and O^T columns: o[n][e] and o[n][2 + e].
    float m[2] = {METRALE_NEG_INF, METRALE_NEG_INF}, l[2] = {0.0f, 0.0f}, o[KS][4];
#pragma unroll
    for (int n = 0; n < KS; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    const TcLoader<D, KF, VF, PAIR> load(w);
    // A unit's partial scores, exchanged in its own rows of smem_o (free until the warps merge):
    // [tile parity][part][4][32]. A unit is two warps (PARTS 2): each adds the other's scores to its
    // own, the same bits in both, as a float sum does not depend on its operands' order. xo indexes
    // this lane's slot of smem_o in the current buffer: its bit 7 is the part, bit 8 the parity.
    static_assert(PARTS <= 2 && (TC_ROWS * ROWD) % (4 * 4 * 32) == 0, "the score exchange pairs two warps");
    int xo = unit * TC_ROWS * ROWD + part * 4 * 32 + lane;
    // S^T (16 keys x 8 heads per query tile) of a tile's K, added to st: K rows g, g + 8 are the A
    // operand as loaded (element sides) or as dequantized (packed sides).
    auto score = [&](const KRow (&kr)[2], float (&st)[4]) {
        if constexpr (KFmt::kPacked && KF != TC_TURBO8) {  // eight codes of each key: two steps
#pragma unroll
            for (int x = 0; x < KS / 2; ++x) {
                unsigned h0[4], h1[4];
                tc_word(kr[0], x, kcodes, h0);
                tc_word(kr[1], x, kcodes, h1);
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const unsigned a[4] = {h0[2 * s], h1[2 * s], h0[2 * s + 1], h1[2 * s + 1]};
                    tc_mma<true>(st, a, qb[2 * x + s]);
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < KS; ++j) {
                unsigned a[4];  // key g low pair, key g + 8 low pair, key g high pair, key g + 8 high
                if constexpr (KFmt::kPacked) {
                    tc_quad(kr[0], j, a[0], a[2]);
                    tc_quad(kr[1], j, a[1], a[3]);
                } else if constexpr (KF16) {
                    const unsigned x0 = kr[0].c[j / 4].w[j % 4], x1 = kr[1].c[j / 4].w[j % 4];
                    a[0] = e4m3x4_lo_to_f16x2(x0);
                    a[1] = e4m3x4_lo_to_f16x2(x1);
                    a[2] = e4m3x4_hi_to_f16x2(x0);
                    a[3] = e4m3x4_hi_to_f16x2(x1);
                } else {
                    a[0] = kr[0].c[j / 2].w[(j % 2) * 2];
                    a[1] = kr[1].c[j / 2].w[(j % 2) * 2];
                    a[2] = kr[0].c[j / 2].w[(j % 2) * 2 + 1];
                    a[3] = kr[1].c[j / 2].w[(j % 2) * 2 + 1];
                }
                tc_mma<KF16>(st, a, qb[j]);
            }
        }
        if constexpr (PARTS > 1) {  // the unit's two parts summed
#pragma unroll
            for (int i = 0; i < 4; ++i) w.smem_o[xo + 32 * i] = st[i];
            tc_unit_sync<32 * PARTS>(unit);  // each buffer is written again two tiles on, after this barrier's next
#pragma unroll
            for (int i = 0; i < 4; ++i) st[i] += w.smem_o[(xo ^ (4 * 32)) + 32 * i];
            xo ^= 2 * 4 * 32;
        }
    };
    // A scored tile's online softmax and O^T += V^T P^T.
    auto accumulate = [&](const float (&st)[4], VRow (&vr)[4], int tile) {
        if constexpr (VSW) tc_v_scales(vr, g, c);
        // Online softmax of heads 2c + e over keys g (st[e]) and g + 8 (st[2 + e]);
        // P^T goes back to registers and, transposed, is the B operand of O^T += V^T P^T.
        const bool live0 = tile + g < w.end, live1 = tile + 8 + g < w.end;
        float corr[2], p0[2], p1[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float x0 = live0 ? st[e] * q_mul : METRALE_NEG_INF;
            const float x1 = live1 ? st[2 + e] * q_mul : METRALE_NEG_INF;
            float mx = fmaxf(x0, x1);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
            const float n = fmaxf(m[e], mx);
            corr[e] = n == METRALE_NEG_INF ? 1.0f : ex2_ftz(m[e] - n);
            m[e] = n;
            p0[e] = ex2_ftz(x0 - n);  // n is finite: a live key's score; a dead one's -inf gives 0
            p1[e] = ex2_ftz(x1 - n);
        }
        const unsigned k0 = tc_pack<VF16>(p0[0], p0[1]), k1 = tc_pack<VF16>(p1[0], p1[1]);
        float r0, r1, r2, r3;  // the probabilities as rounded: the sum is of what P V uses
        tc_unpack<VF16>(k0, r0, r1);
        tc_unpack<VF16>(k1, r2, r3);
        l[0] = l[0] * corr[0] + r0 + r2;
        l[1] = l[1] * corr[1] + r1 + r3;
        const unsigned pb[2] = {movmatrix_trans(k0),   // P[head g][keys 2c, 2c + 1]
                                movmatrix_trans(k1)};  // ... keys 8 + 2c, 9 + 2c
        if (PAIR || corr[0] != 1.0f || corr[1] != 1.0f) {  // most tiles keep the maxima; PAIR: no branch
#pragma unroll
            for (int n = 0; n < KS; ++n) {
                o[n][0] *= corr[0];
                o[n][1] *= corr[1];
                o[n][2] *= corr[0];
                o[n][3] *= corr[1];
            }
        }
        // the last tile: a dead key's V is zeroed (a packed one's scales too): 0 x NaN is NaN (PAIR: as loaded)
        if (!PAIR && tile + 16 > w.end) {
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                if (tile + tc_v_key(c, v) >= w.end) {
                    if constexpr (VFmt::kPacked) {
#pragma unroll
                        for (int x = 0; x < (VRow::kBytes + 3) / 4; ++x) vr[v].w[x] = 0u;
                        vr[v].scales = 0u;
                    } else {
#pragma unroll
                        for (int x = 0; x < VW; ++x) vr[v].w[x] = 0u;
                    }
                }
            }
        }
        // V^T as the A operand of output tile n: rows g, g + 8 are dims tc_out_dim(n, 0 / 1, g),
        // columns keys 2c, 2c + 1 (registers 0, 1) and 8 + 2c, 9 + 2c (2, 3): each register
        // pairs one dim of two keys, byte-permuted from the two keys' words.
        if constexpr (VF == TC_NVFP4) {  // word x of each key: tiles 4x .. 4x + 3
            unsigned sc[2];  // keys 8h + 2c and 8h + 2c + 1: their scales (a slice lies in one group)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                sc[h] = tc_e4m3_f16x2(tc_v_scale_pair<VSW>(vr[2 * h], vr[2 * h + 1], g));
#pragma unroll
            for (int x = 0; x < KS / 4; ++x) {
                unsigned a[4][4];  // tile 4x + p: dims 8x + p (row g) and 8x + p + 4 (row g + 8)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    unsigned lo[4], hi[4];
                    tc_e2m1_pair(vr[2 * h].w[x], vr[2 * h + 1].w[x], sc[h], lo, hi);
#pragma unroll
                    for (int p = 0; p < 4; ++p) {
                        a[p][2 * h] = lo[p];
                        a[p][2 * h + 1] = hi[p];
                    }
                }
#pragma unroll
                for (int p = 0; p < 4; ++p) tc_mma<true>(o[4 * x + p], a[p], pb);
            }
        } else if constexpr (VFmt::kPacked && VF != TC_TURBO8) {  // codes 8x .. 8x + 7: tiles 4x .. 4x + 3
#pragma unroll
            for (int x = 0; x < KS / 4; ++x) {
                unsigned a[4][4];  // tile 4x + i: dims 8x + 2i (row g) and 8x + 2i + 1 (row g + 8)
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // keys 8h + 2c and 8h + 2c + 1
                    unsigned pv[8];  // a slice lies in one group: its scale pair from tc_v_scale_pair
                    const unsigned vx = tc_code_bits(vr[2 * h], x), vy = tc_code_bits(vr[2 * h + 1], x);
                    tc_code_pair<VF>(vx, vy, vcodes, tc_e4m3_f16x2(tc_v_scale_pair<VSW>(vr[2 * h], vr[2 * h + 1], g)), pv);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        a[i][2 * h] = pv[2 * i];
                        a[i][2 * h + 1] = pv[2 * i + 1];
                    }
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) tc_mma<true>(o[4 * x + i], a[i], pb);
            }
        } else if constexpr (VFmt::kPacked) {  // turbo8: word m of each key: tiles 2m and 2m + 1
            // Register 2h + r of tile 2m + t: dim 4m + 2t + r of keys 8h + 2c (low), 8h + 2c + 1
            // (high), bytes 2t + r of the keys' words, one bf16x2 multiply by their factor.
            unsigned f[2], top = 0u;
#pragma unroll
            for (int h = 0; h < 2; ++h) f[h] = tc_turbo8_factor(vr[2 * h].scales, vr[2 * h + 1].scales, top);
            if (__reduce_max_sync(0xffffffffu, top) <= TC_TURBO8_FACTOR_MAX) {
#pragma unroll
                for (int m = 0; m < KS / 2; ++m) {
                    unsigned a0[4], a1[4];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const unsigned x = vr[2 * h].w[m], y = vr[2 * h + 1].w[m];
                        a0[2 * h] = mul_bf16x2(tc_e4m3_bf16<0, 4>(x, y), f[h]);
                        a0[2 * h + 1] = mul_bf16x2(tc_e4m3_bf16<1, 5>(x, y), f[h]);
                        a1[2 * h] = mul_bf16x2(tc_e4m3_bf16<2, 6>(x, y), f[h]);
                        a1[2 * h + 1] = mul_bf16x2(tc_e4m3_bf16<3, 7>(x, y), f[h]);
                    }
                    tc_mma<VF16>(o[2 * m], a0, pb);
                    tc_mma<VF16>(o[2 * m + 1], a1, pb);
                }
            } else {  // a scale of 256 or more in the warp's tile: each element in fp32 (tc_pair)
#pragma unroll
                for (int m = 0; m < KS / 2; ++m) {
                    unsigned a0[4], a1[4];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        unsigned x0, x1, y0, y1;
                        tc_quad(vr[2 * h], m, x0, x1);      // key 8h + 2c
                        tc_quad(vr[2 * h + 1], m, y0, y1);  // key 8h + 2c + 1
                        a0[2 * h] = __byte_perm(x0, y0, 0x5410);
                        a0[2 * h + 1] = __byte_perm(x0, y0, 0x7632);
                        a1[2 * h] = __byte_perm(x1, y1, 0x5410);
                        a1[2 * h + 1] = __byte_perm(x1, y1, 0x7632);
                    }
                    tc_mma<VF16>(o[2 * m], a0, pb);
                    tc_mma<VF16>(o[2 * m + 1], a1, pb);
                }
            }
        } else {
#pragma unroll
            for (int n = 0; n < KS; ++n) {
                unsigned a[4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const VRow& lo = vr[2 * h];     // key 8h + 2c
                    const VRow& hi = vr[2 * h + 1];  // key 8h + 2c + 1
                    if constexpr (VF16) {  // bytes 2(n % 2), + 1 of word n / 2: the tile's two dims
                        const int b = 2 * (n % 2);
                        const unsigned x = __byte_perm(lo.w[n / 2], hi.w[n / 2],
                                                       b | (b + 4) << 4 | (b + 1) << 8 | (b + 5) << 12);
                        a[2 * h] = e4m3x4_lo_to_f16x2(x);      // dim 2n (row g)
                        a[2 * h + 1] = e4m3x4_hi_to_f16x2(x);  // dim 2n + 1 (row g + 8)
                    } else {  // word n: the tile's two dims
                        a[2 * h] = __byte_perm(lo.w[n], hi.w[n], 0x5410);
                        a[2 * h + 1] = __byte_perm(lo.w[n], hi.w[n], 0x7632);
                    }
                }
                tc_mma<VF16>(o[n], a, pb);
            }
        }
    };
    if constexpr (PAIR) {
        // Two tiles a pass (the warp's next two), the next pass's two in flight. Both are scored
        // before either is accumulated, which is the order of one a pass: the same bits. A tile
        // past the end is loaded as zeros, and accumulating it changes nothing (its scores are
        // masked: the maxima stay, corr is 1, P and V are 0), so a pass has no branch.
        constexpr int STEP = 16 * UNITS;
        KRow ka[2], kb[2];
        VRow va[4], vb[4];
        load(w.begin + 16 * unit, ka, va);
        load(w.begin + 16 * unit + STEP, kb, vb);
        for (int tile = w.begin + 16 * unit; tile < w.end; tile += 2 * STEP) {
            KRow kna[2], knb[2];
            VRow vna[4], vnb[4];
            load(tile + 2 * STEP, kna, vna);
            load(tile + 3 * STEP, knb, vnb);
            float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            score(ka, sa);
            score(kb, sb);
            accumulate(sa, va, tile);
            accumulate(sb, vb, tile + STEP);
#pragma unroll
            for (int h = 0; h < 2; ++h) ka[h] = kna[h], kb[h] = knb[h];
#pragma unroll
            for (int x = 0; x < 4; ++x) va[x] = vna[x], vb[x] = vnb[x];
        }
    } else if constexpr (TURNS) {
        // The warp's next tile in flight while this one is scored, two tiles a pass: the two
        // buffers take turns (a pass's second tile is loaded into the first one's registers), so
        // nothing is copied from one to the other.
        constexpr int STEP = 16 * UNITS;
        KRow ka[2], kb[2];
        VRow va[4], vb[4];
        int tile = w.begin + 16 * unit;
        if (first != nullptr) {
#pragma unroll
            for (int h = 0; h < 2; ++h) ka[h] = first->k[h];
#pragma unroll
            for (int x = 0; x < 4; ++x) va[x] = first->v[x];
        } else if (tile < w.end) {
            load(tile, ka, va);
        }
        for (; tile < w.end; tile += 2 * STEP) {
            if (tile + STEP < w.end) load(tile + STEP, kb, vb);
            float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            score(ka, sa);
            accumulate(sa, va, tile);
            if (tile + STEP >= w.end) break;
            if (tile + 2 * STEP < w.end) load(tile + 2 * STEP, ka, va);
            float sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            score(kb, sb);
            accumulate(sb, vb, tile + STEP);
        }
    } else {
        KRow kr[2], kn[2];
        VRow vr[4], vn[4];
        const bool peel = !PREFETCH && first != nullptr;  // the first tile apart: the loop loads each of its own
        if (first != nullptr) {
#pragma unroll
            for (int h = 0; h < 2; ++h) kr[h] = first->k[h];
#pragma unroll
            for (int x = 0; x < 4; ++x) vr[x] = first->v[x];
            if (peel && w.begin + 16 * unit < w.end) {
                float st[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                score(kr, st);
                accumulate(st, vr, w.begin + 16 * unit);
            }
        } else if (PREFETCH && w.begin + 16 * unit < w.end) {
            load(w.begin + 16 * unit, kr, vr);
        }
        for (int tile = w.begin + 16 * unit + (peel ? 16 * UNITS : 0); tile < w.end; tile += 16 * UNITS) {
            if constexpr (PREFETCH) {  // the warp's next tile is in flight while this one is scored
                if (tile + 16 * UNITS < w.end) load(tile + 16 * UNITS, kn, vn);
            } else {
                load(tile, kr, vr);
            }
            float st[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            score(kr, st);
            accumulate(st, vr, tile);
            if constexpr (PREFETCH) {
#pragma unroll
                for (int h = 0; h < 2; ++h) kr[h] = kn[h];
#pragma unroll
                for (int x = 0; x < 4; ++x) vr[x] = vn[x];
            }
        }
    }

    // A head's sum over its 8 lanes; then the units merge through shared memory.
    if constexpr (PARTS > 1) tc_unit_sync<32 * PARTS>(unit);  // the unit's exchange read before its rows are
    float* so = w.smem_o + unit * TC_ROWS * ROWD;
    float* sml = w.smem_ml + unit * TC_ROWS * 2;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 4);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 8);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 16);
        const int r = 2 * c + e;
        if (r < w.rows) {
#pragma unroll
            for (int n = 0; n < KS; ++n) {
                so[r * ROWD + d0 + tc_out_dim<DW, VF>(n, 0, g)] = o[n][e];
                so[r * ROWD + d0 + tc_out_dim<DW, VF>(n, 1, g)] = o[n][2 + e];
            }
            if (g == 0 && part == 0) {  // the unit's warps hold the same maxima and sums
                sml[r * 2] = m[e];
                sml[r * 2 + 1] = l[e];
            }
        }
    }
    CTA_SYNC();
    const float v_mul = VF == TC_NVFP4 ? w.v_scale * TC_E2M1_UNIT : w.v_scale;
    for (int idx = threadIdx.x; idx < w.rows * D; idx += WARPS * 32) {
        const int r = idx / D, d = idx % D;
        float big = METRALE_NEG_INF;
#pragma unroll
        for (int v = 0; v < UNITS; ++v) big = fmaxf(big, w.smem_ml[(v * TC_ROWS + r) * 2]);
        float sum = 0.0f, val = 0.0f;
        if (big != METRALE_NEG_INF) {
#pragma unroll
            for (int v = 0; v < UNITS; ++v) {
                const float f = exp2f(w.smem_ml[(v * TC_ROWS + r) * 2] - big);  // 0 for an idle unit
                sum += w.smem_ml[(v * TC_ROWS + r) * 2 + 1] * f;
                val += w.smem_o[(v * TC_ROWS + r) * ROWD + d] * f;
            }
        }
        val *= v_mul;
        const long long head = w.head0 + r;
        if (w.keep_o != nullptr) {
            w.keep_o[r * D + d] = val;
            if (d == 0) {
                w.keep_ml[r * 2] = big;
                w.keep_ml[r * 2 + 1] = sum;
            }
        } else if (w.part_o == nullptr) {
            w.out[head * D + d] = f32_to_bf16(sum > 0.0f ? val / sum : 0.0f);
        } else {
            const long long part = head * w.num_splits + w.split;
            w.part_o[part * D + d] = val;
            if (d == 0) {
                w.part_ml[part * 2] = big;
                w.part_ml[part * 2 + 1] = sum;
            }
        }
    }
}
