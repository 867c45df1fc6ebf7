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
// InnerQ division would store it: row (D bf16, shared) = bf16(R row), then bf16(that / the scales
// of KV head kvh) when channel is set. y: D floats of scratch. Run by one warp.
template <int D>
__device__ void rotate_query(bf16_t* row, const float* signs, const float* channel, int kvh, float* y) {
    wht_rotate_row<D>(row, signs, signs + D, y);
    if (channel == nullptr) return;
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < D; i += 32) row[i] = f32_to_bf16(__fdiv_rn(bf16_to_f32(row[i]), channel[kvh * D + i]));
    __syncwarp();
}

// One CTA of 64 threads per (token, y). y < Hk: KV head y, warp 0 normalizes, rotates and stores
// K, warp 1 stores V (nothing when the slot is negative). y >= Hk: warp w takes query head
// 2 * (y - Hk) + w and writes it, normalized and rotated, to q_out (T, Hq, D); with rotate_q also
// in the K side's basis (rotate_query).
template <class KW, class VW, int D>
__device__ void rope_and_cache_head(const RopeCacheArgs& a, HeadScratch& s) {
    const long long t = blockIdx.x;
    const int y = blockIdx.y, warp = threadIdx.x >> 5;
    const int half = a.rot_dim / 2;
    const long long pos = a.positions[t];
    const float* cos_row = a.cos_table + pos * half;
    const float* sin_row = a.sin_table + pos * half;
    if (y < a.hk) {
        const int slot = a.slot_mapping[t];
        if (slot < 0) return;
        if (warp == 0) {
            const bf16_t* k = a.k + t * a.k_stride + (long long)y * D;
            norm_rope<D>(k, a.k_norm, a.eps, cos_row, sin_row, half, s.row);
            store_vector<KW, D>(s.row, a.k_cache, slot, y, a.hk, a.k_scale, a.k_signs, a.channel,
                                s.write);
        } else {
            const bf16_t* v = a.v + t * a.v_stride + (long long)y * D;
            store_vector<VW, D>(v, a.v_cache, slot, y, a.hk, a.v_scale, a.v_signs, nullptr,
                                s.write);
        }
        return;
    }
    const int head = (y - a.hk) * ROPE_CACHE_WARPS + warp;
    if (head >= a.hq) return;
    const bf16_t* q = a.q + t * a.q_stride + (long long)head * D;
    norm_rope<D>(q, a.q_norm, a.eps, cos_row, sin_row, half, s.row);
    if (a.rotate_q) rotate_query<D>(s.row, a.k_signs, a.channel, head / (a.hq / a.hk), s.write.y);
    store_row<D>(s.row, a.q_out + (t * a.hq + head) * D);
}

template <class KW, class VW>
__device__ void rope_and_cache(const RopeCacheArgs& a, int head_dim) {
    __shared__ HeadScratch scratch[ROPE_CACHE_WARPS];  // sized for D = 512, shared by every D
    const int warp = threadIdx.x >> 5;
    if (warp >= ROPE_CACHE_WARPS) return;
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
        pdl_wait();                                                                                \
        pdl_launch_dependents();                                                                   \
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
