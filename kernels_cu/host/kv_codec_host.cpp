// The KV side types' cache write (store_vector) and per-lane read (side::load / decode) as a
// host library, so tests can compare their bytes and values with the torch codecs on a CPU:
//   g++ -std=c++20 -O1 -ffp-contract=off -fno-gnu-unique -shared -fPIC -I../include kv_codec_host.cpp -o kv.so
#include "emulate.h"
#include "kv_write.cuh"

namespace {

template <class W, int D>
void write_all(const bf16_t* src, void* pool, const int* slots, int tokens, int hk, const float* scale,
               const float* signs, const float* channel) {
    static WriteScratch scratch;
    for (int t = 0; t < tokens; ++t) {
        if (slots[t] < 0) continue;
        for (int h = 0; h < hk; ++h) {
            const bf16_t* x = src + ((long long)t * hk + h) * D;
            const float* row = channel_row(channel, h, D);
            run_warp([&] { store_vector<W, D>(x, pool, slots[t], h, hk, scale, signs, row, scratch); });
        }
    }
}

template <template <int> class S, int D>
void read_all(const void* pool, int slots, int hk, float* out) {
    float lut[16];
    for (int i = 0; i < 16; ++i) lut[i] = i < S<D>::kLevels ? S<D>::level(i) : 0.0f;
    for (int slot = 0; slot < slots; ++slot)
        for (int h = 0; h < hk; ++h)
            for (int lane = 0; lane < 32; ++lane) {
                const auto raw = S<D>::load(pool, slot / KV_BLOCK, kv_row(slot % KV_BLOCK, h), hk, lane);
                S<D>::decode(raw, lut, out + ((long long)slot * hk + h) * D + lane * (D / 32));
            }
}

template <class W, template <int> class S>
int run(int head_dim, bool write, const bf16_t* src, void* pool, const int* slots, int n, int hk,
        const float* scale, const float* signs, const float* channel, float* out) {
#define METRALE_HOST_CASE(D)                                                     \
    case D:                                                                      \
        if (write) write_all<W, D>(src, pool, slots, n, hk, scale, signs, channel); \
        else read_all<S, D>(pool, n, hk, out);                                   \
        return 0;
    switch (head_dim) {
        METRALE_HOST_CASE(64)
        METRALE_HOST_CASE(128)
        METRALE_HOST_CASE(256)
        METRALE_HOST_CASE(512)
    }
    return 1;
}

}  // namespace

// side: 0 bf16, 1 fp8, 2 nvfp4, 3 turbo2, 4 turbo3, 5 turbo4, 6 turbo8.
// write = 1: store src (n, Hk, D) bf16 at slots (n,) into pool; write = 0: decode the first n
// slots of pool into out (n, Hk, D) fp32 (fp8: before the per-tensor scale). 0 on success.
extern "C" int kv_codec_host(int side, int head_dim, int write, const bf16_t* src, void* pool,
                             const int* slots, int n, int hk, const float* scale, const float* signs,
                             const float* channel, float* out) {
#define METRALE_HOST_SIDE(i, name) \
    case i: return run<store_##name, side_##name>(head_dim, write, src, pool, slots, n, hk, scale, signs, channel, out);
    switch (side) {
        METRALE_HOST_SIDE(0, bf16)
        METRALE_HOST_SIDE(1, fp8)
        METRALE_HOST_SIDE(2, nvfp4)
        METRALE_HOST_SIDE(3, turbo2)
        METRALE_HOST_SIDE(4, turbo3)
        METRALE_HOST_SIDE(5, turbo4)
        METRALE_HOST_SIDE(6, turbo8)
    }
    return 2;
}

// numeric.cuh's software e4m3 (the conversions of GPUs below sm_89) over n values: x -> bytes,
// and bytes -> their f16 bits; and the emulation's own conversion of x, for the tests to hold the
// two to each other and to torch's e4m3fn.
extern "C" void e4m3_software_host(const float* x, unsigned char* bytes, unsigned char* emulated, int n,
                                   const unsigned char* codes, unsigned short* f16, int m) {
    for (int i = 0; i < n; ++i) {
        bytes[i] = (unsigned char)e4m3_from_f32(x[i]);
        emulated[i] = (unsigned char)(f32x2_to_e4m3x2(x[i], 0.0f) & 0xffu);
    }
    for (int i = 0; i < m; ++i) f16[i] = (unsigned short)e4m3_to_f16_bits(codes[i]);
}
