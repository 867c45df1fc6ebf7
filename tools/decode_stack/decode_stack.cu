// One batch-1 decode step through every layer of a dense bf16 model with a bf16 KV cache, in one
// persistent launch: the layers' seven launches each (norm + q/k/v GEMV, QK-norm + RoPE + cache
// write, tensor-core decode, split combine, o_proj + residual, norm + gate/up + SwiGLU,
// down + residual) become phases of one grid.
//
// Why: at batch 1 a small model's layer reads a few MB of weights, which the H200 streams in a
// few microseconds, about what a launch and its ramp-up cost. Here the weights never wait on the
// activations: each CTA (one per SM) owns a fixed slice of every projection's rows and streams
// them through a ring of STACK_STAGES shared-memory stages with bulk asynchronous copies (TMA),
// issued as soon as a stage frees, across phase and layer boundaries; a phase's GEMV then reads
// its weights from shared memory as soon as its input is ready.
//
// No grid-wide barrier: the vectors one phase hands to the next (qkv, attention output, the
// running sum after attention and after the FFN, the SwiGLU activation) are written as flagged
// words (LL, as NCCL's low-latency protocol): a 64-bit store of the bf16 value and a 32-bit flag
// naming the launch, layer and vector. A reader spins on the words it needs until they carry
// the flag it expects, so it waits for its producers only, with one trip through L2 and no fence.
// Launches are told apart by a generation count that CTA 0 bumps when it ends.
//
// Phases of layer l (each CTA):
//   QKV   x = RMSNorm(h) (gemv.cuh's stage_row), qkv[rows] = W_qkv[rows] · x
//   ATTN  work items (KV head, group chunk, split): QK-norm + RoPE of the item's query heads into
//         shared memory, the new K / V written to the cache by the split holding the last key,
//         decode_tc (decode_tc.cuh) over the split; the last split of an item to finish (a
//         counter per item) combines the partials into attn
//   O     h_attn[rows] = h[rows] + W_o[rows] · attn
//   GU    x = RMSNorm(h_attn), act[i] = silu(gate_i · x) · (up_i · x)
//   DOWN  h[rows] = h_attn[rows] + W_down[rows] · act (the last layer writes the plain bf16 output)
// A CTA owns the same rows of h in O and DOWN and keeps them in shared memory. The GEMVs round
// exactly as gemv.cu's kernels (a warp per row, each lane summing its 16-byte chunks in order, the
// same prologue), QK-norm / RoPE / the cache bytes exactly as rope_and_cache_bf16; attention
// splits its context its own way (so its fp32 sums may differ in the last bits from
// paged_decode_attn_tc + combine).
//
// Residency: every CTA must be resident at once (readers wait on every other CTA's words). The
// host launches one CTA per SM and the shared memory one CTA takes (about 200 KB) leaves no room
// for a second.
// The consumer warps' barrier (named barrier 1): the producer warp takes no part in it.
#define STACK_WARPS 8
#define STACK_THREADS (STACK_WARPS * 32)
#define CTA_SYNC() asm volatile("bar.sync 1, %0;" ::"n"(STACK_THREADS) : "memory")
#define CTA_WARPS STACK_WARPS
#include "bulk_copy.cuh"
#include "decode_tc.cuh"
#include "gemv.cuh"
#include "head_norm.cuh"
#include "pdl.cuh"

#define STACK_BLOCK (STACK_THREADS + 32)  // the consumer warps and the producer warp
#define STACK_STAGES 5
#define STACK_STAGE_BYTES 32768
#define STACK_MAX_K 12288  // the widest GEMV input row (bf16, staged in shared memory)
#define STACK_SCRATCH_BYTES 33280  // max(x row, decode_tc's STACK_WARPS x TC_ROWS partials)
#define STACK_MAX_LAYERS 128
#ifndef STACK_POLL_NS
#define STACK_POLL_NS 1000  // back-off between polls of flagged words that are not ready yet
#endif
#define STACK_MAX_OWN 256  // rows of the hidden state per CTA: hidden <= 256 x the SM count
#define STACK_LAYER_FIELDS 10      // the layer table's pointers, in this order:
enum LayerField { W_QKV, W_O, W_GATE_UP, W_DOWN, INPUT_NORM, POST_NORM, Q_NORM, K_NORM, K_CACHE, V_CACHE };
enum StackPhase { QKV, O_PROJ, GATE_UP, DOWN, GEMV_PHASES };
// The flagged vectors of a layer, in the order of their flags (flag = base + VECTORS * l + v).
enum Vector { V_QKV, V_ATTN, V_H_ATTN, V_ACT, V_H_FFN, VECTORS };

static_assert(STACK_MAX_K * 2 <= STACK_SCRATCH_BYTES, "x row in scratch");
static_assert(STACK_WARPS * TC_ROWS * (TC_MAX_D + 2) * 4 <= STACK_SCRATCH_BYTES, "decode_tc in scratch");

// Shared memory (dynamic), in bytes from its start.
#define STACK_RING 0
#define STACK_SCRATCH (STACK_STAGES * STACK_STAGE_BYTES)
#define STACK_QROWS (STACK_SCRATCH + STACK_SCRATCH_BYTES)  // TC_ROWS query heads after norm + RoPE
#define STACK_KROW (STACK_QROWS + TC_ROWS * TC_MAX_D * 2)  // the new key after norm + RoPE
#define STACK_ROWS (STACK_KROW + TC_MAX_D * 2)  // a head row per warp, read from flagged words
#define STACK_WEIGHTS (STACK_ROWS + STACK_WARPS * TC_MAX_D * 2)  // the layers' projection pointers
#define STACK_OWN (STACK_WEIGHTS + STACK_MAX_LAYERS * GEMV_PHASES * 8)  // this CTA's rows of h
#define STACK_MBAR (STACK_OWN + STACK_MAX_OWN * 2)  // a full-barrier per stage
#define STACK_EMPTY (STACK_MBAR + STACK_STAGES * 8)  // an empty-barrier per stage
#define STACK_SMEM_BYTES (STACK_EMPTY + STACK_STAGES * 8 + 16)

// The weight stream's pace. A bulk copy of a whole stage (32 KB) from every SM at once fills the
// memory system's queues: while they drain, every hand-off's trip through L2 waits behind them
// (an H200, 132 CTAs handing a vector round, tools/handoff_latency.py: 1.5 us a hop alone, 8 us
// under a stream of 4 x 32 KB copies per SM, 1.7 us under 4 x 4 KB). So a stage is copied in
// pieces of STACK_PIECE_BYTES, each after a STACK_PACE_NS sleep, which caps the stream's rate
// (Qwen3-0.6B's shape: 803 us a step in whole stages, 747 in 4 KB pieces 100 ns apart, 766 at
// 200 ns; 0 copies whole stages).
#ifndef STACK_PIECE_BYTES
#define STACK_PIECE_BYTES 4096
#endif
#ifndef STACK_PACE_NS
#define STACK_PACE_NS 100
#endif

__device__ __forceinline__ void stream_copy(unsigned char* dst, const bf16_t* src, unsigned bytes,
                                            unsigned long long* bar) {
#if STACK_PIECE_BYTES
    const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
    for (unsigned o = 0; o < bytes; o += STACK_PIECE_BYTES) {
        if (STACK_PACE_NS) __nanosleep(STACK_PACE_NS);
        bulk_copy(dst + o, s + o, min((unsigned)STACK_PIECE_BYTES, bytes - o), bar);
    }
#else
    bulk_copy(dst, src, bytes, bar);
#endif
}

// --- flagged words ------------------------------------------------------------------------------
typedef unsigned long long Word;  // flag << 32 | bf16 value

__device__ __forceinline__ void ll_store(Word* p, bf16_t v, unsigned flag) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"((Word)flag << 32 | v) : "memory");
}

__device__ __forceinline__ bf16_t ll_value(Word w) { return (bf16_t)(w & 0xffffu); }

// Elements i .. i + 7 of a flagged vector, once all eight carry `flag`.
__device__ __forceinline__ void ll_load8(const Word* p, unsigned flag, float* out) {
    Word w[8];
    bool ready;
    do {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];"
                         : "=l"(w[2 * i]), "=l"(w[2 * i + 1])
                         : "l"(p + 2 * i)
                         : "memory");
        }
        ready = true;
#pragma unroll
        for (int i = 0; i < 8; ++i) ready &= (unsigned)(w[i] >> 32) == flag;
        // Every CTA polls the same few lines: backing off leaves L2 to the writers (Qwen3-0.6B on
        // an H200: 855 us a step without, 836 at 200 ns, 781 at 1000).
        if (!ready) __nanosleep(STACK_POLL_NS);
    } while (!ready);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = bf16_to_f32(ll_value(w[i]));
}

// A flagged vector as stage_row's source (see BfRow).
struct LlRow {
    const Word* p;
    unsigned flag;
    __device__ void operator()(int i, float* a) const { ll_load8(p + i, flag, a); }
    __device__ Chunk chunk(int i) const {
        float a[8];
        ll_load8(p + i, flag, a);
        Chunk c;
#pragma unroll
        for (int j = 0; j < 4; ++j) c.w[j] = f32_to_bf16(a[2 * j]) | (unsigned)f32_to_bf16(a[2 * j + 1]) << 16;
        return c;
    }
};

// One head row (D elements) of a flagged vector into shared memory, by one warp.
template <int D>
__device__ void ll_head(const Word* p, unsigned flag, bf16_t* row) {
    const int lane = threadIdx.x & 31;
    if (lane < D / 8) {
        float a[8];
        ll_load8(p + 8 * lane, flag, a);
        store_vec<8>(row + 8 * lane, a);
    }
    __syncwarp();
}

// A profiling build (tools/decode_stack_profile.py): each CTA's clock at every phase boundary.
#ifdef STACK_TRACE
#define STACK_TRACE_CTAS 256
#define STACK_TRACE_EVENTS 1024
__device__ long long stack_trace[STACK_TRACE_CTAS * STACK_TRACE_EVENTS];
#define TRACE(e)                                                                  \
    if (threadIdx.x == 0 && blockIdx.x < STACK_TRACE_CTAS && (e) < STACK_TRACE_EVENTS) \
    stack_trace[blockIdx.x * STACK_TRACE_EVENTS + (e)] = clock64()
#else
#define TRACE(e) ((void)(e))
#endif

// --- the schedule of weight chunks --------------------------------------------------------------
struct StackArgs {
    const unsigned long long* layers;  // (num_layers, STACK_LAYER_FIELDS) pointers
    int num_layers;
    bf16_t* h;  // in: the token's embedding; out: the running sum after the last layer
    Word *qkv, *attn, *h_attn, *act, *h_ffn;  // the flagged vectors, in the `words` buffer
    float *part_o, *part_ml;
    unsigned* sync;  // the launch generation, a spare word, then a counter per attention item
    const int *block_table, *seq_lens, *slot_mapping, *positions;
    const float *cos_table, *sin_table;
    int hidden, hq, hk, head_dim, rot_dim, inter, num_splits;
    float eps, scale;
};

// This CTA's share of one GEMV phase: tasks [t0, t1) (rows, or gate/up row pairs), `per` of them
// per ring stage.
struct Share {
    int k, t0, t1, per, chunks;
    bool pair;
};

struct Schedule {
    Share s[GEMV_PHASES];
    int per_layer;  // chunks of one layer
    int total;

    __device__ Schedule(const StackArgs& a) {
        const int q_size = a.hq * a.head_dim, kv_size = a.hk * a.head_dim;
        const int n[GEMV_PHASES] = {q_size + 2 * kv_size, a.hidden, a.inter, a.hidden};
        const int k[GEMV_PHASES] = {a.hidden, q_size, a.hidden, a.inter};
        per_layer = 0;
#pragma unroll
        for (int p = 0; p < GEMV_PHASES; ++p) {
            Share& x = s[p];
            x.k = k[p];
            x.pair = p == GATE_UP;
            x.t0 = (int)((long long)blockIdx.x * n[p] / gridDim.x);
            x.t1 = (int)((long long)(blockIdx.x + 1) * n[p] / gridDim.x);
            x.per = STACK_STAGE_BYTES / (k[p] * 2 * (x.pair ? 2 : 1));
            x.chunks = (x.t1 - x.t0 + x.per - 1) / x.per;
            per_layer += x.chunks;
        }
        total = per_layer * a.num_layers;
    }
};

// Issue chunk j of this CTA's weight stream into stage j % STACK_STAGES (the producer;
// `weights`: the layers' four projection pointers, staged in shared memory).
__device__ void issue(const StackArgs& a, const Schedule& sc, int j, const bf16_t* const* weights,
                      unsigned char* ring, unsigned long long* bars) {
    const int layer = j / sc.per_layer;
    int r = j - layer * sc.per_layer, p = 0;
    while (r >= sc.s[p].chunks) r -= sc.s[p].chunks, ++p;
    const Share& x = sc.s[p];
    const int t = x.t0 + r * x.per, cnt = min(x.per, x.t1 - t);
    const bf16_t* w = weights[layer * GEMV_PHASES + p];
    const unsigned bytes = (unsigned)cnt * x.k * 2;
    const int stage = j % STACK_STAGES;
    unsigned char* dst = ring + stage * STACK_STAGE_BYTES;
    mbar_expect(bars + stage, x.pair ? 2 * bytes : bytes);
    stream_copy(dst, w + (long long)t * x.k, bytes, bars + stage);
    if (x.pair) stream_copy(dst + bytes, w + ((long long)a.inter + t) * x.k, bytes, bars + stage);
}

// The producer warp's lane 0: the whole weight stream of the launch, a stage refilled as soon
// as every consumer warp has released it.
__device__ void produce(const StackArgs& a, const Schedule& sc, const bf16_t* const* weights,
                        unsigned char* ring, unsigned long long* full, unsigned long long* empty) {
    for (int j = 0; j < sc.total; ++j) {
        const int stage = j % STACK_STAGES;
        if (j >= STACK_STAGES) mbar_wait(empty + stage, (unsigned)((j / STACK_STAGES - 1) & 1));
        issue(a, sc, j, weights, ring, full);
    }
}

// One GEMV phase of this CTA: its chunks j0 .. j0 + chunks - 1, x staged in xs; each warp
// releases a stage when it has read its rows. Returns the next chunk index.
// (flags: layer l's flag base, base + VECTORS * l; first / last: l is the first / last layer;
// own: this CTA's rows of the running sum, which it alone writes, kept in shared memory.)
template <StackPhase P>
__device__ int gemv_phase(const StackArgs& a, const Schedule& sc, int j0, const Chunk* xs,
                          const bf16_t* const* weights, unsigned char* ring, unsigned long long* bars,
                          unsigned flags, bool first, bool last, bf16_t* own, unsigned long long* empty) {
    const Share& x = sc.s[P];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, chunks8 = x.k / 8;
    for (int c = 0; c < x.chunks; ++c) {
        const int j = j0 + c;
        const int stage = j % STACK_STAGES;
#ifndef STACK_TIMING_NO_WEIGHT_WAIT  // timing only (wrong output): the phase without its weight waits
        mbar_wait(bars + stage, (unsigned)((j / STACK_STAGES) & 1));
#endif
        const int t = x.t0 + c * x.per, cnt = min(x.per, x.t1 - t);
        const Chunk* ws = reinterpret_cast<const Chunk*>(ring + stage * STACK_STAGE_BYTES);
        for (int i = warp; i < cnt; i += STACK_WARPS) {
            const Chunk* row = ws + (long long)i * chunks8;
            float acc = 0.0f, acc_up = 0.0f;
#ifndef STACK_TIMING_NO_DOT  // timing only (wrong output): the phase without its dot products
#pragma unroll 4
            for (int ci = lane; ci < chunks8; ci += 32) {
                const Chunk xv = xs[ci];
                acc = dot8(row[ci], xv, acc);
                if constexpr (P == GATE_UP) acc_up = dot8(row[(long long)cnt * chunks8 + ci], xv, acc_up);
            }
#endif
            acc = warp_sum(acc);
            if constexpr (P == GATE_UP) acc_up = warp_sum(acc_up);
            if (lane == 0) {
                const int n = t + i;
                if constexpr (P == QKV) {
                    ll_store(a.qkv + n, f32_to_bf16(acc), flags + V_QKV);
                } else if constexpr (P == GATE_UP) {
                    const float g = round_bf16(acc), u = round_bf16(acc_up);
                    ll_store(a.act + n, f32_to_bf16(round_bf16(g / (1.0f + expf(-g))) * u), flags + V_ACT);
                } else if constexpr (P == O_PROJ) {
                    const bf16_t r = first ? a.h[n] : own[n - x.t0];
                    own[n - x.t0] = f32_to_bf16(bf16_to_f32(r) + round_bf16(acc));
                    ll_store(a.h_attn + n, own[n - x.t0], flags + V_H_ATTN);
                } else {
                    own[n - x.t0] = f32_to_bf16(bf16_to_f32(own[n - x.t0]) + round_bf16(acc));
                    if (last) a.h[n] = own[n - x.t0];
                    else ll_store(a.h_ffn + n, own[n - x.t0], flags + V_H_FFN);
                }
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + stage);  // this warp is done with the stage
    }
    CTA_SYNC();  // xs is restaged next
    return j0 + x.chunks;
}

// --- attention ----------------------------------------------------------------------------------
template <int D>
__device__ void attention_phase(const StackArgs& a, const unsigned long long* layer, unsigned char* smem,
                                unsigned flags) {
    const int warp = threadIdx.x >> 5;
    const int group = a.hq / a.hk, chunks = (group + TC_ROWS - 1) / TC_ROWS;
    const int items = a.hk * chunks * a.num_splits;
    const int len = a.seq_lens[0], per_split = split_keys(len, a.num_splits);
    const int active = active_splits(len, a.num_splits);
    const int half = a.rot_dim / 2, slot = a.slot_mapping[0];
    const long long pos = a.positions[0];
    const float* cos_row = a.cos_table + pos * half;
    const float* sin_row = a.sin_table + pos * half;
    bf16_t* qrows = reinterpret_cast<bf16_t*>(smem + STACK_QROWS);
    bf16_t* krow = reinterpret_cast<bf16_t*>(smem + STACK_KROW);
    bf16_t* row = reinterpret_cast<bf16_t*>(smem + STACK_ROWS) + warp * TC_MAX_D;  // this warp's
    float* smem_o = reinterpret_cast<float*>(smem + STACK_SCRATCH);
    float* smem_ml = smem_o + STACK_WARPS * TC_ROWS * TC_MAX_D;
    int* last = reinterpret_cast<int*>(smem + STACK_EMPTY + STACK_STAGES * 8);
    const bf16_t* q_norm = reinterpret_cast<const bf16_t*>(layer[Q_NORM]);
    const bf16_t* k_norm = reinterpret_cast<const bf16_t*>(layer[K_NORM]);
    bf16_t* k_cache = reinterpret_cast<bf16_t*>(layer[K_CACHE]);
    bf16_t* v_cache = reinterpret_cast<bf16_t*>(layer[V_CACHE]);
    const int q_size = a.hq * D, kv_size = a.hk * D;

    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int kvh = item / (chunks * a.num_splits), rest = item % (chunks * a.num_splits);
        const int chunk = rest / a.num_splits, split = rest % a.num_splits;
        const int begin = split * per_split;
        if (begin >= len) continue;
        const int end = min(len, begin + per_split);
        const int rows = min(TC_ROWS, group - chunk * TC_ROWS);
        const int head0 = kvh * group + chunk * TC_ROWS;
        const bool writes = end == len && slot >= 0;  // this split holds the new key
        for (int x = warp; x < rows + 2; x += STACK_WARPS) {
            if (x < rows) {
                ll_head<D>(a.qkv + (long long)(head0 + x) * D, flags + V_QKV, row);
                norm_rope<D>(row, q_norm, a.eps, cos_row, sin_row, half, qrows + x * D);
            } else if (writes && x == rows) {
                ll_head<D>(a.qkv + q_size + (long long)kvh * D, flags + V_QKV, row);
                norm_rope<D>(row, k_norm, a.eps, cos_row, sin_row, half, krow);
                store_row<D>(krow, k_cache + kv_vector(slot, kvh, a.hk) * D);
            } else if (writes) {
                ll_head<D>(a.qkv + q_size + kv_size + (long long)kvh * D, flags + V_QKV, row);
                store_row<D>(row, v_cache + kv_vector(slot, kvh, a.hk) * D);
            }
            __syncwarp();
        }
        CTA_SYNC();  // q rows staged; the new key's K / V stored (visible to this CTA)
        const TcWork w{qrows,
                       reinterpret_cast<const unsigned char*>(k_cache),
                       reinterpret_cast<const unsigned char*>(v_cache),
                       a.block_table,
                       head0,
                       rows,
                       a.hk,
                       kvh,
                       begin,
                       end,
                       a.num_splits,
                       split,
                       a.scale,
                       1.0f,
                       nullptr,
                       a.part_o,  // always split (one split included): the combine writes flagged words
                       a.part_ml,
                       smem_o,
                       smem_ml};
        decode_tc<D, TC_BF16, TC_BF16, STACK_WARPS>(w);
        // The last of the item's active splits to finish combines them (paged_decode_combine's sums).
        CTA_SYNC();
        if (threadIdx.x == 0) {
            unsigned* counter = a.sync + 2 + kvh * chunks + chunk;
            __threadfence();
            const bool is_last = atomicAdd(counter, 1u) == (unsigned)active - 1;
            if (is_last) atomicExch(counter, 0u);
            __threadfence();
            *last = is_last;
        }
        CTA_SYNC();
        if (*last) {
            for (int idx = threadIdx.x; idx < rows * D; idx += STACK_THREADS) {
                const int r = idx / D, d = idx % D;
                const long long head = head0 + r;
                const float* ml = a.part_ml + head * a.num_splits * 2;
                const float* po = a.part_o + head * a.num_splits * D;
                float big = METRALE_NEG_INF;
                for (int s = 0; s < active; ++s) big = fmaxf(big, __ldcg(ml + 2 * s));
                float total = 0.0f, val = 0.0f;
                if (big != METRALE_NEG_INF) {
                    for (int s = 0; s < active; ++s) {
                        const float f = exp2f(__ldcg(ml + 2 * s) - big);
                        total += __ldcg(ml + 2 * s + 1) * f;
                        val += __ldcg(po + s * D + d) * f;
                    }
                }
                ll_store(a.attn + head * D + d, f32_to_bf16(total > 0.0f ? val / total : 0.0f), flags + V_ATTN);
            }
        }
        CTA_SYNC();
    }
}

// --- the step -----------------------------------------------------------------------------------

template <int D>
__device__ void decode_stack(const StackArgs& a) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem + STACK_RING;
    Chunk* xs = reinterpret_cast<Chunk*>(smem + STACK_SCRATCH);
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem + STACK_MBAR);
    const bf16_t** weights = reinterpret_cast<const bf16_t**>(smem + STACK_WEIGHTS);
    bf16_t* own = reinterpret_cast<bf16_t*>(smem + STACK_OWN);
    const Schedule sc(a);
    for (int i = threadIdx.x; i < a.num_layers * GEMV_PHASES; i += STACK_THREADS) {
        weights[i] = reinterpret_cast<const bf16_t*>(a.layers[i / GEMV_PHASES * STACK_LAYER_FIELDS + i % GEMV_PHASES]);
    }
    unsigned long long* empty = reinterpret_cast<unsigned long long*>(smem + STACK_EMPTY);
    if (threadIdx.x == STACK_THREADS) {
        for (int s = 0; s < STACK_STAGES; ++s) {
            mbar_init(bars + s, 1);
            mbar_init(empty + s, STACK_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the whole block, the producer warp included
    if (threadIdx.x >= STACK_THREADS) {  // the producer: weights only, so it need not wait (PDL)
        if (threadIdx.x == STACK_THREADS) produce(a, sc, weights, ring, bars, empty);
        return;
    }
    pdl_wait();
    unsigned* generation = reinterpret_cast<unsigned*>(smem + STACK_EMPTY + STACK_STAGES * 8 + 4);
    if (threadIdx.x == 0) *generation = *reinterpret_cast<volatile unsigned*>(a.sync);
    CTA_SYNC();
    const unsigned base = *generation * (VECTORS * a.num_layers) + 1;  // 0: a zeroed word's flag
    const int q_size = a.hq * D;
    int j = 0;
    TRACE(0);
    for (int l = 0; l < a.num_layers; ++l) {
        const int e = 1 + 8 * l;
        const unsigned flags = base + VECTORS * l;
        const bool first = l == 0, last = l == a.num_layers - 1;
        const unsigned long long* layer = a.layers + (long long)l * STACK_LAYER_FIELDS;
        const bf16_t* input_norm = reinterpret_cast<const bf16_t*>(layer[INPUT_NORM]);
        const bf16_t* post_norm = reinterpret_cast<const bf16_t*>(layer[POST_NORM]);

        if (first) stage_x<true>(xs, a.h, nullptr, input_norm, nullptr, a.hidden, a.eps);
        else stage_row<true>(xs, LlRow{a.h_ffn, flags - VECTORS + V_H_FFN}, nullptr, input_norm, nullptr, a.hidden, a.eps);
        TRACE(e);
        j = gemv_phase<QKV>(a, sc, j, xs, weights, ring, bars, flags, first, last, own, empty);
        TRACE(e + 1);
        attention_phase<D>(a, layer, smem, flags);
        TRACE(e + 2);
        stage_row<false>(xs, LlRow{a.attn, flags + V_ATTN}, nullptr, nullptr, nullptr, q_size, 0.0f);
        TRACE(e + 3);
        j = gemv_phase<O_PROJ>(a, sc, j, xs, weights, ring, bars, flags, first, last, own, empty);
        TRACE(e + 4);
        stage_row<true>(xs, LlRow{a.h_attn, flags + V_H_ATTN}, nullptr, post_norm, nullptr, a.hidden, a.eps);
        TRACE(e + 5);
        j = gemv_phase<GATE_UP>(a, sc, j, xs, weights, ring, bars, flags, first, last, own, empty);
        TRACE(e + 6);
        if (last) pdl_launch_dependents();
        stage_row<false>(xs, LlRow{a.act, flags + V_ACT}, nullptr, nullptr, nullptr, a.inter, 0.0f);
        j = gemv_phase<DOWN>(a, sc, j, xs, weights, ring, bars, flags, first, last, own, empty);
        TRACE(e + 7);
    }
    // Every CTA has read the generation (CTA 0 cannot get here before each has written its q/k/v
    // words of layer 0): the next launch gets the next one.
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(a.sync, 1u);
}

// h (hidden,) bf16: in, the embedding of the step's token; out, the running sum after the last
// layer (the final norm and LM head follow: gemv_norm_bf16). layers: (num_layers, 10) int64
// pointers per layer: W_qkv (q_size + 2 kv_size, hidden), W_o (hidden, q_size),
// W_gate_up (2 inter, hidden), W_down (hidden, inter), input / post-attention norm (hidden,),
// q_norm / k_norm (head_dim,) or 0, the bf16 K / V pools (NB, hk, 16, head_dim). words: the
// flagged vectors, 64-bit words: qkv (q_size + 2 kv_size), attn (q_size), h_attn (hidden),
// act (inter), h_ffn (hidden), zero before the first launch. part_o / part_ml:
// (hq, num_splits, head_dim) / (hq, num_splits, 2) fp32. sync: 2 + hk * ceil(group / 8) words,
// zero before the first launch (word 0 counts launches; every launch leaves the rest zero).
// block_table (max_blocks,) int32; seq_lens, slot_mapping, positions (1,) int32; cos / sin
// (max_pos, rot_dim / 2) fp32. num_layers <= STACK_MAX_LAYERS, head_dim 64 or 128, every GEMV
// input row (hidden, q_size, inter) a multiple of 8 elements and at most STACK_MAX_K, a gate/up
// row pair within one ring stage. grid = the SM count, block = STACK_BLOCK, dynamic shared memory
// STACK_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(STACK_BLOCK, 1)
    decode_stack_bf16(const unsigned long long* layers, int num_layers, bf16_t* h, Word* words,
                      float* part_o, float* part_ml, unsigned* sync, const int* block_table,
                      const int* seq_lens, const int* slot_mapping, const int* positions,
                      const float* cos_table, const float* sin_table, int hidden, int hq, int hk,
                      int head_dim, int rot_dim, int inter, int num_splits, float eps, float scale) {
    const int q_size = hq * head_dim, qkv_size = q_size + 2 * hk * head_dim;
    Word* attn = words + qkv_size;
    Word* h_attn = attn + q_size;
    Word* act = h_attn + hidden;
    Word* h_ffn = act + inter;
    const StackArgs a{layers,    num_layers,  h,         words,      attn,       h_attn,
                      act,       h_ffn,       part_o,    part_ml,    sync,       block_table,
                      seq_lens,  slot_mapping, positions, cos_table, sin_table,  hidden,
                      hq,        hk,          head_dim,  rot_dim,    inter,      num_splits,
                      eps,       scale};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (head_dim == 64) decode_stack<64>(a);
    else if (head_dim == 128) decode_stack<128>(a);
#else
    (void)a;
    __trap();  // bulk copies and transaction barriers are sm_90's: the host plans no launch below it
#endif
}
