// SwiGLU gate: out = bf16(bf16(silu(gate)) * up), the rounding order of torch's silu(g) * u.
#include "numeric.cuh"

template <int V>
__device__ void silu_mul_span(const bf16_t* gate, const bf16_t* up, bf16_t* out, int i) {
    float g[V], u[V];
    load_vec<V>(gate + i, g);
    load_vec<V>(up + i, u);
#pragma unroll
    for (int j = 0; j < V; ++j) g[j] = silu_mul(g[j], u[j]);
    store_vec<V>(out + i, g);
}

// gate_up: (T, 2I) = [gate | up] bf16 -> out: (T, I) bf16. grid = (T, ceil(I / (blockDim*8))).
extern "C" __global__ void silu_and_mul_bf16(const bf16_t* gate_up, bf16_t* out, int inter) {
    const long long t = blockIdx.x;
    const bf16_t* gate = gate_up + t * 2 * inter;
    const bf16_t* up = gate + inter;
    bf16_t* o = out + t * inter;
    const int start = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (start >= inter) return;
    if ((inter & 7) == 0 && aligned16(gate) && aligned16(o)) {
        silu_mul_span<8>(gate, up, o, start);
    } else {
        const int end = min(start + 8, inter);
        for (int i = start; i < end; ++i) silu_mul_span<1>(gate, up, o, i);
    }
}
