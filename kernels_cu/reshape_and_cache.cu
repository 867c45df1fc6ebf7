// Paged KV-cache writes of the unrotated dtypes. bf16 / fp8 caches are (NB, Hk, 16, D): a token's
// Hk head vectors are copied (or quantized) to their kv_vector places, D elements each. nvfp4
// caches are packed uint8 blocks (kv_write.cuh). Compiled with --fmad=false: the nvfp4 bytes are
// bit-exact (bf16 / fp8 only copy and divide).
#include "kv_write.cuh"

// V elements at a time; V divides d, so a run of V never crosses from one head to the next.
template <typename CacheT, int V>
__device__ void store_heads(const bf16_t* src, CacheT* cache, long long slot, int hk, int d, float scale) {
    for (int i = threadIdx.x * V; i < hk * d; i += blockDim.x * V) {
        const int head = i / d;
        float f[V];
        load_vec<V>(src + i, f);
        if constexpr (sizeof(CacheT) == 1) {
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = f[j] / scale;  // true division, as the reference
        }
        store_vec<V>(cache + kv_vector(slot, head, hk) * d + (i - head * d), f);
    }
}

template <typename CacheT>
__device__ void cache_token(const bf16_t* src, CacheT* cache, long long slot, int hk, int d, float scale) {
    if ((d & 7) == 0 && aligned16(src) && aligned16(cache)) {
        store_heads<CacheT, 8>(src, cache, slot, hk, d, scale);
    } else {
        store_heads<CacheT, 1>(src, cache, slot, hk, d, scale);
    }
}

// k, v: (T, Hk, D) bf16; slot_mapping: (T,) int32 (negative = skip). grid = T.
extern "C" __global__ void reshape_and_cache_flash(const bf16_t* k, const bf16_t* v,
                                                   bf16_t* k_cache, bf16_t* v_cache,
                                                   const int* slot_mapping, int num_kv_heads,
                                                   int head_dim) {
    const long long t = blockIdx.x;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int n = num_kv_heads * head_dim;
    cache_token<bf16_t>(k + t * n, k_cache, slot, num_kv_heads, head_dim, 1.0f);
    cache_token<bf16_t>(v + t * n, v_cache, slot, num_kv_heads, head_dim, 1.0f);
}

// As above into e4m3 caches: stored = e4m3(x / scale), RNE, saturated to +-448.
// k_scale, v_scale: (1,) fp32 device tensors (rewritable under a captured graph).
extern "C" __global__ void reshape_and_cache_flash_fp8(const bf16_t* k, const bf16_t* v,
                                                       fp8_t* k_cache, fp8_t* v_cache,
                                                       const int* slot_mapping,
                                                       const float* k_scale, const float* v_scale,
                                                       int num_kv_heads, int head_dim) {
    const long long t = blockIdx.x;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int n = num_kv_heads * head_dim;
    cache_token<fp8_t>(k + t * n, k_cache, slot, num_kv_heads, head_dim, *k_scale);
    cache_token<fp8_t>(v + t * n, v_cache, slot, num_kv_heads, head_dim, *v_scale);
}

// As above into packed nvfp4 pools: k_cache, v_cache: (NB, block_bytes) uint8
// (docs/kv-formats.md). grid = (T, Hk), block = 64 (a warp per side).
extern "C" __global__ void __launch_bounds__(64)
    reshape_and_cache_flash_nvfp4(const bf16_t* k, const bf16_t* v, u8_t* k_cache, u8_t* v_cache,
                                  const int* slot_mapping, int num_kv_heads, int head_dim) {
    write_kv<store_nvfp4, store_nvfp4>(k, v, k_cache, v_cache, slot_mapping, nullptr, nullptr,
                                       nullptr, nullptr, nullptr, num_kv_heads, head_dim);
}
