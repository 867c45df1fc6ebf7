// Paged KV-cache writes of the turbo dtypes and of every asymmetric pair: one templated body
// (kv_write.cuh) per (K side, V side), entry points named reshape_and_cache_flash_<dtype>.
// A rotated side rotates by its WHT signs in fp32 inside the write; K also takes the InnerQ
// channel scales when they are set. Compiled with --fmad=false (bit-exact bytes).
#include "kv_write.cuh"

// k, v: (T, Hk, D) bf16 in the original basis; slot_mapping: (T,) int32 (negative = skip);
// k_cache / v_cache: the side pools (bf16 / e4m3 (NB, Hk, 16, D) or uint8 (NB, block_bytes));
// k_scale, v_scale: (1,) fp32 (read by an fp8 side); k_signs, v_signs: (2, D) fp32 of a rotated
// side, else null; channel_scale: (Hk, D) fp32 or null. grid = (T, Hk), block = 64.
#define METRALE_WRITE_ENTRY(dtype, K, V)                                                          \
    extern "C" __global__ void __launch_bounds__(64) reshape_and_cache_flash_##dtype(            \
        const bf16_t* k, const bf16_t* v, void* k_cache, void* v_cache, const int* slot_mapping, \
        const float* k_scale, const float* v_scale, const float* k_signs, const float* v_signs,  \
        const float* channel_scale, int num_kv_heads, int head_dim) {                            \
        write_kv<store_##K, store_##V>(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,   \
                                       k_signs, v_signs, channel_scale, num_kv_heads, head_dim); \
    }

METRALE_WRITE_ENTRY(turbo4, turbo4, turbo4)
METRALE_WRITE_ENTRY(turbo3, turbo3, turbo3)
METRALE_WRITE_ENTRY(turbo2, turbo2, turbo2)
METRALE_WRITE_ENTRY(turbo8, turbo8, turbo8)
METRALE_WRITE_ENTRY(turbo4k_turbo3v, turbo4, turbo3)
METRALE_WRITE_ENTRY(turbo4k_turbo8v, turbo4, turbo8)
METRALE_WRITE_ENTRY(turbo3k_turbo8v, turbo3, turbo8)
METRALE_WRITE_ENTRY(bf16k_turbo4v, bf16, turbo4)
METRALE_WRITE_ENTRY(bf16k_turbo3v, bf16, turbo3)
METRALE_WRITE_ENTRY(bf16k_turbo2v, bf16, turbo2)
METRALE_WRITE_ENTRY(fp8k_turbo4v, fp8, turbo4)
METRALE_WRITE_ENTRY(fp8k_turbo3v, fp8, turbo3)
METRALE_WRITE_ENTRY(fp8k_turbo2v, fp8, turbo2)
