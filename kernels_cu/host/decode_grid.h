// A paged decode launch as CudaOps makes it, on the emulated CPU: the decode kernel over its grid
// (hk, batch, z), then paged_decode_combine over (hq, batch) when the context is split (v_signs: a
// rotated V side's signs, for the combine to rotate the output back). Include
// after paged_decode.cu (the combine).
#pragma once
#include <functional>

inline void run_paged_decode(int hk, int batch, int z_count, unsigned threads, const std::function<void()>& decode,
                             const float* part_o, const float* part_ml, const int* seq_lens, bf16_t* out, int hq,
                             int head_dim, int num_splits, const float* v_signs = nullptr) {
    for (int z = 0; z < z_count; ++z)
        for (int y = 0; y < batch; ++y)
            for (int x = 0; x < hk; ++x) run_block({(unsigned)x, (unsigned)y, (unsigned)z}, threads, decode);
    if (num_splits > 1)
        for (int y = 0; y < batch; ++y)
            for (int x = 0; x < hq; ++x)
                run_block({(unsigned)x, (unsigned)y, 0}, 128, [&] {
                    paged_decode_combine(part_o, part_ml, seq_lens, out, hq, head_dim, num_splits, v_signs);
                });
}
