// The decode GEMVs of gemv.cu as a host library, each run over a grid of `ctas` CTAs as CudaOps
// launches it (CudaOps uses two per SM; a small grid makes every warp walk several rows), so tests
// can check the row mapping, the batches of a row, the fused prologue and the epilogues on a CPU:
//   g++ -std=c++20 -O1 -ffp-contract=off -fno-gnu-unique -shared -fPIC -I../include gemv_host.cpp -o gemv.so
#include "emulate.h"
#include "../gemv.cu"
#include "../rmsnorm.cu"

// The unfused norm the GEMV prologue must equal: add_rms_norm_bf16 (or rms_norm_bf16 without a
// residual) over one row, with CudaOps' block size.
extern "C" void host_norm(const bf16_t* x, const bf16_t* residual, const bf16_t* gamma, bf16_t* out, bf16_t* sum_out,
                          int k, float eps) {
    run_block({0, 0, 0}, k >= 2048 ? 256 : 128, [&] {
        if (residual)
            add_rms_norm_bf16(x, residual, gamma, out, sum_out, k, eps);
        else
            rms_norm_bf16(x, gamma, out, k, eps);
    });
}

// kind 0: gemv_norm_bf16, 1: gemv_norm_swiglu_bf16 (n = inter), 2: gemv_add_bf16, 3:
// gemv_norm_logits_bf16 (out is then n floats).
extern "C" void host_gemv(int kind, const bf16_t* w, const bf16_t* x, const bf16_t* residual, const bf16_t* gamma,
                          bf16_t* sum_out, bf16_t* out, int n, int k, float eps, int ctas) {
    gridDim = {(unsigned)ctas, 1, 1};
    for (int b = 0; b < ctas; ++b)
        run_block({(unsigned)b, 0, 0}, GEMV_THREADS, [&] {
            if (kind == 0)
                gemv_norm_bf16(w, x, residual, gamma, sum_out, out, n, k, eps);
            else if (kind == 3)
                gemv_norm_logits_bf16(w, x, residual, gamma, sum_out, reinterpret_cast<float*>(out), n, k, eps);
            else if (kind == 1)
                gemv_norm_swiglu_bf16(w, x, residual, gamma, sum_out, out, n, k, eps);
            else
                gemv_add_bf16(w, x, residual, out, n, k);
        });
    gridDim = {1, 1, 1};
}

// gemv_gate_add_bf16 over `ctas` CTAs.
extern "C" void host_gemv_gate_add(const bf16_t* w, const bf16_t* x, const bf16_t* gate, const bf16_t* residual,
                                   bf16_t* out, int n, int k, int ctas) {
    gridDim = {(unsigned)ctas, 1, 1};
    for (int b = 0; b < ctas; ++b)
        run_block({(unsigned)b, 0, 0}, GEMV_THREADS, [&] { gemv_gate_add_bf16(w, x, gate, residual, out, n, k); });
    gridDim = {1, 1, 1};
}
