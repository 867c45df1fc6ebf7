// The weight reads of batch 1's MoE gate/up (moe_gate_up_one_bf16) as pure loads, no MMAs, in four
// layouts, for tools/expert_read_patterns.py. A launch reads E experts' gate and up rows (2 * I rows
// of H bf16 each). grid (I / 16, E), 4 warps; a warp takes 16 gate rows and 16 up rows x 64
// elements a block (4 KB), 8 loads of 16 bytes a lane, H / 64 / 4 blocks, a ring of DEPTH blocks
// in registers (block i + DEPTH - 1 loaded before block i is used), as TcWork::pass:
//   rows   (0) the expert's rows as stored (row-major, H apart); warp w takes blocks w, w + 4, ..;
//              lane 4g + c reads 16 bytes of rows g, g + 8 of each tile, 32 bytes apart (today's)
//   rowsw  (1) the same layout, warp w taking blocks 8w .. 8w + 7 (a contiguous K range a warp)
//   tiled  (2) a block's 4 KB stored contiguously, in the order the lanes read it (512 bytes a load
//              instruction); warps w, w + 4, ..
//   run    (3) tiled, a warp's blocks contiguous
// The loaded words are folded into one word written only if it equals a constant, so no load is
// dropped.
struct Chunk16 {
    unsigned w[4];
};

__device__ __forceinline__ Chunk16 load16(const char* p) {
    Chunk16 c;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(c.w[0]), "=r"(c.w[1]), "=r"(c.w[2]), "=r"(c.w[3])
                 : "l"(p));
    return c;
}

// Lane's load i (0 .. 7) of block kb of the CTA's tile.
template <int MODE>
__device__ __forceinline__ const char* address(const char* base, int H, int I, int kb, int i) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long expert = (long long)blockIdx.y * 2 * I * H * 2;
    if (MODE <= 1) {  // load i: tile t (gate, up), row g + 8h, half
        const int t = i >> 2, h = (i >> 1) & 1, half = i & 1;
        const long long row = blockIdx.x * 16 + g + 8 * h + (long long)t * I;
        return base + expert + row * H * 2 + (kb * 64 + 16 * c + 8 * half) * 2;
    }
    const long long block = (long long)blockIdx.x * (H / 64) + kb;
    return base + expert + block * 4096 + i * 512 + lane * 16;
}

template <int MODE, int DEPTH>
__device__ void read_tiles(const char* base, int H, int I, unsigned* sink) {
    const int warp = threadIdx.x >> 5, per = H / 64 / 4;
    auto block_of = [&](int j) { return (MODE == 1 || MODE == 3) ? warp * per + j : warp + 4 * j; };
    unsigned acc = 0;
    Chunk16 a[DEPTH][8];
#pragma unroll
    for (int s = 0; s < DEPTH - 1; ++s)
#pragma unroll
        for (int i = 0; i < 8; ++i) a[s][i] = load16(address<MODE>(base, H, I, block_of(s), i));
    for (int j0 = 0; j0 < per; j0 += DEPTH) {
#pragma unroll
        for (int s = 0; s < DEPTH; ++s) {
            const int j = j0 + s, next = j + DEPTH - 1;
            if (next < per) {
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    a[(s + DEPTH - 1) % DEPTH][i] = load16(address<MODE>(base, H, I, block_of(next), i));
            }
            if (j < per) {
#pragma unroll
                for (int i = 0; i < 8; ++i) acc ^= a[s][i].w[0] + 3u * a[s][i].w[1] + 5u * a[s][i].w[2] + a[s][i].w[3];
            }
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

#define READ_ENTRY(name, mode, depth)                                                       \
    extern "C" __global__ void __launch_bounds__(128) name(const char* base, int H, int I, \
                                                            unsigned* sink) {              \
        read_tiles<mode, depth>(base, H, I, sink);                                         \
    }
READ_ENTRY(rows2, 0, 2)
READ_ENTRY(rows3, 0, 3)
READ_ENTRY(rowsw2, 1, 2)
READ_ENTRY(rowsw3, 1, 3)
READ_ENTRY(tiled2, 2, 2)
READ_ENTRY(tiled3, 2, 3)
READ_ENTRY(run2, 3, 2)
READ_ENTRY(run3, 3, 3)
