// QK-norm + RoPE + paged KV-cache write in one launch: the per-layer prologue of attention.
// Byte for byte the unfused sequence rms_norm_bf16 (q heads), rms_norm_bf16 (k heads),
// rope_neox_bf16, reshape_and_cache_flash_<dtype>: the norm is rms_row.cuh's arithmetic over the
// same 8-element chunks and in the same reduction order as rmsnorm.cu's block on a row of
// head_dim, the rotation is rope.cuh's, the write is kv_write.cuh's store_vector (WHT rotation,
// InnerQ channel scales, fp8 scale, skipped slots). The roped K only lives in shared memory.
// One templated body, an entry point rope_and_cache_<dtype> per KV dtype. Compiled with
// --fmad=false (bit-exact cache bytes; rms_row.cuh spells its fused multiply-adds).
#include "head_norm.cuh"
#include "kv_write.cuh"
#include "pdl.cuh"

#define ROPE_CACHE_WARPS 2

struct HeadScratch {
    bf16_t row[WRITE_MAX_D];  // the head after norm and RoPE
    WriteScratch write;
    // The warp's constants, loaded before the PDL wait (none comes from the launch just before):
    // the position's cos and sin halves, the head's norm weights, its side's WHT signs (the K
    // side's for a query) and its KV head's InnerQ scales.
    float cos_sin[WRITE_MAX_D];
    __align__(16) bf16_t norm[WRITE_MAX_D];
    float signs[2 * WRITE_MAX_D];
    float channel[WRITE_MAX_D];
};

// The kernel's parameters (see the entry points below).
struct RopeCacheArgs {
    const bf16_t *q, *k, *v;
    bf16_t* q_out;
    void *k_cache, *v_cache;
    const int *slot_mapping, *positions;
    const float *cos_table, *sin_table;
    const bf16_t *q_norm, *k_norm;
    const float *k_scale, *v_scale, *k_signs, *v_signs, *channel;
    int q_stride, k_stride, v_stride, hq, hk, rot_dim;
    float eps;
    int rotate_q;
};

// The query in a rotated K side's basis, as the unrotated query then wht_bf16_inplace and the
// InnerQ division would store it: row (D bf16, shared) = bf16(R row), then bf16(that / channel)
// when channel (its KV head's D scales) is set. y: D floats of scratch. Run by one warp.
template <int D>
__device__ void rotate_query(bf16_t* row, const float* signs, const float* channel, float* y) {
    wht_rotate_row<D>(row, signs, signs + D, y);
    if (channel == nullptr) return;
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < D; i += 32) row[i] = f32_to_bf16(__fdiv_rn(bf16_to_f32(row[i]), channel[i]));
    __syncwarp();
}

// n floats or bf16s from global memory to the warp's shared copy (null when src is).
template <class T>
__device__ const T* stage_warp(const T* src, T* dst, int n) {
    if (src == nullptr) return nullptr;
    for (int i = threadIdx.x & 31; i < n; i += 32) dst[i] = src[i];
    return dst;
}

// One CTA of 64 threads per (token, y). y < Hk: KV head y, warp 0 normalizes, rotates and stores
// K, warp 1 stores V (nothing when the slot is negative). y >= Hk: warp w takes query head
// 2 * (y - Hk) + w and writes it, normalized and rotated, to q_out (T, Hq, D); with rotate_q also
// in the K side's basis (rotate_query). Before its PDL wait a warp stages its constants and reads
// the token's slot and position (a step's inputs, written launches before: pdl.cuh); q / k / v,
// the launch before's output, only after it.
template <class KW, class VW, int D>
__device__ void rope_and_cache_head(const RopeCacheArgs& a, HeadScratch& s) {
    const long long t = blockIdx.x;
    const int y = blockIdx.y, warp = threadIdx.x >> 5;
    const int half = a.rot_dim / 2;
    const bool kv = y < a.hk, writes_v = kv && warp == 1;
    const int head = kv ? y : (y - a.hk) * ROPE_CACHE_WARPS + warp;  // a KV head, or a query head
    const int kvh = kv ? y : head / (a.hq / a.hk);
    const int slot = kv ? __ldcg(a.slot_mapping + t) : 0;
    const bool works = kv ? slot >= 0 : head < a.hq;
    const float *cos_row = nullptr, *sin_row = nullptr, *signs = nullptr, *channel = nullptr;
    const bf16_t* norm = nullptr;
    if (works && !writes_v) {
        const long long pos = __ldcg(a.positions + t);
        cos_row = stage_warp(a.cos_table + pos * half, s.cos_sin, half);
        sin_row = stage_warp(a.sin_table + pos * half, s.cos_sin + half, half);
        norm = stage_warp(kv ? a.k_norm : a.q_norm, s.norm, D);
        if (kv || a.rotate_q) {
            signs = stage_warp(a.k_signs, s.signs, 2 * D);
            channel = stage_warp(channel_row(a.channel, kvh, D), s.channel, D);
        }
    } else if (works) {
        signs = stage_warp(a.v_signs, s.signs, 2 * D);
    }
    __syncwarp();
    pdl_wait();
    pdl_launch_dependents();
    if (!works) return;
    if (kv) {
        if (!writes_v) {
            const bf16_t* k = a.k + t * a.k_stride + (long long)y * D;
            norm_rope<D>(k, norm, a.eps, cos_row, sin_row, half, s.row);
            store_vector<KW, D>(s.row, a.k_cache, slot, y, a.hk, a.k_scale, signs, channel, s.write);
        } else {
            const bf16_t* v = a.v + t * a.v_stride + (long long)y * D;
            store_vector<VW, D>(v, a.v_cache, slot, y, a.hk, a.v_scale, signs, nullptr, s.write);
        }
        return;
    }
    const bf16_t* q = a.q + t * a.q_stride + (long long)head * D;
    norm_rope<D>(q, norm, a.eps, cos_row, sin_row, half, s.row);
    if (a.rotate_q && signs != nullptr) rotate_query<D>(s.row, signs, channel, s.write.y);
    store_row<D>(s.row, a.q_out + (t * a.hq + head) * D);
}

template <class KW, class VW>
__device__ void rope_and_cache(const RopeCacheArgs& a, int head_dim) {
    __shared__ HeadScratch scratch[ROPE_CACHE_WARPS];  // sized for D = 512, shared by every D
    const int warp = threadIdx.x >> 5;
    if (warp >= ROPE_CACHE_WARPS) {
        pdl_wait();
        pdl_launch_dependents();
        return;
    }
    switch (head_dim) {
        case 64: rope_and_cache_head<KW, VW, 64>(a, scratch[warp]); break;
        case 128: rope_and_cache_head<KW, VW, 128>(a, scratch[warp]); break;
        case 256: rope_and_cache_head<KW, VW, 256>(a, scratch[warp]); break;
        case 512: rope_and_cache_head<KW, VW, 512>(a, scratch[warp]); break;
    }
}

// q: Hq heads, k / v: Hk heads of head_dim bf16 per token, token t at t * {q,k,v}_stride
// elements; q_out: (T, Hq, D) bf16; k_cache / v_cache: the side pools; slot_mapping, positions:
// (T,) int32 (slot < 0: no write); cos / sin: (max_pos, rot_dim / 2) fp32; q_norm / k_norm: (D,)
// bf16 or null (no QK-norm); k_scale, v_scale: (1,) fp32; k_signs / v_signs: (2, D) fp32 of a
// rotated side, else null; channel_scale: (Hk, D) fp32 InnerQ scales or null; rotate_q: q_out is
// R q (divided by the scales of its KV head when channel_scale is set), rotated by k_signs (set).
// grid = (T, Hk + ceil(Hq / 2)), block = 64. head_dim: 64, 128, 256 or 512; rot_dim even, <= D.
#define METRALE_ROPE_CACHE_ENTRY(dtype, K, V)                                                      \
    extern "C" __global__ void __launch_bounds__(ROPE_CACHE_WARPS * 32) rope_and_cache_##dtype(    \
        const bf16_t* q, const bf16_t* k, const bf16_t* v, bf16_t* q_out, void* k_cache,           \
        void* v_cache, const int* slot_mapping, const int* positions, const float* cos_table,      \
        const float* sin_table, const bf16_t* q_norm, const bf16_t* k_norm, const float* k_scale,  \
        const float* v_scale, const float* k_signs, const float* v_signs,                          \
        const float* channel_scale, int q_stride, int k_stride, int v_stride, int hq, int hk,      \
        int head_dim, int rot_dim, float eps, int rotate_q) {                                      \
        const RopeCacheArgs a{q, k, v, q_out, k_cache, v_cache, slot_mapping, positions,           \
                              cos_table, sin_table, q_norm, k_norm, k_scale, v_scale, k_signs,     \
                              v_signs, channel_scale, q_stride, k_stride, v_stride, hq, hk,        \
                              rot_dim, eps, rotate_q};                                             \
        rope_and_cache<store_##K, store_##V>(a, head_dim);                                         \
    }

METRALE_ROPE_CACHE_ENTRY(bf16, bf16, bf16)
METRALE_ROPE_CACHE_ENTRY(fp8, fp8, fp8)
METRALE_ROPE_CACHE_ENTRY(nvfp4, nvfp4, nvfp4)
METRALE_ROPE_CACHE_ENTRY(turbo4, turbo4, turbo4)
METRALE_ROPE_CACHE_ENTRY(turbo3, turbo3, turbo3)
METRALE_ROPE_CACHE_ENTRY(turbo2, turbo2, turbo2)
METRALE_ROPE_CACHE_ENTRY(turbo8, turbo8, turbo8)
METRALE_ROPE_CACHE_ENTRY(turbo4k_turbo3v, turbo4, turbo3)
METRALE_ROPE_CACHE_ENTRY(turbo4k_turbo8v, turbo4, turbo8)
METRALE_ROPE_CACHE_ENTRY(turbo3k_turbo8v, turbo3, turbo8)
METRALE_ROPE_CACHE_ENTRY(bf16k_turbo4v, bf16, turbo4)
METRALE_ROPE_CACHE_ENTRY(bf16k_turbo3v, bf16, turbo3)
METRALE_ROPE_CACHE_ENTRY(bf16k_turbo2v, bf16, turbo2)
METRALE_ROPE_CACHE_ENTRY(fp8k_turbo4v, fp8, turbo4)
METRALE_ROPE_CACHE_ENTRY(fp8k_turbo3v, fp8, turbo3)
METRALE_ROPE_CACHE_ENTRY(fp8k_turbo2v, fp8, turbo2)
