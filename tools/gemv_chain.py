"""Time the decode GEMVs of a whole layer stack without attention (GPU only).

    python tools/gemv_chain.py

For Qwen3-8B's and Qwen3-0.6B's shapes on random weights, each layer runs its four fused GEMVs
as the batch-1 decode path does (norm + q/k/v, o_proj + residual, norm + gate/up + SwiGLU,
down + residual; o_proj reads the first q-size outputs of q/k/v in place of attention's). The
chain is captured in a CUDA graph, once without and once with the LM head, and replayed. It prints
the time per layer and the bandwidth the weights stream at. Set against `metrale bench`, the
difference per layer is what attention adds to a decode step.
"""

from __future__ import annotations

import torch

from metrale_cli.kernels.cuda_ops import CudaOps

# name: hidden, q size, kv size, intermediate, layers, vocabulary
SHAPES = {"qwen3-8b": (4096, 4096, 1024, 12288, 36, 151936), "qwen3-0.6b": (1024, 2048, 1024, 3072, 28, 151936)}


def _weights(rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02


def _norm(size: int) -> torch.Tensor:
    return torch.rand(size, device="cuda", dtype=torch.bfloat16) + 0.5


def replay_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def chain(ops: CudaOps, name: str, reps: int = 20) -> None:
    hidden, q_size, kv_size, inter, layers, vocab = SHAPES[name]
    stack = [dict(qkv=_weights(q_size + 2 * kv_size, hidden), o=_weights(hidden, q_size),
                  gate_up=_weights(2 * inter, hidden), down=_weights(hidden, inter), norm=_norm(hidden),
                  post_norm=_norm(hidden)) for _ in range(layers)]
    lm_head, final_norm = _weights(vocab, hidden), _norm(hidden)
    h0 = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)

    def step(with_head: bool) -> torch.Tensor:
        x = h0
        for w in stack:
            qkv, _ = ops.gemv_norm(x, None, w["norm"], 1e-6, w["qkv"])
            x = ops.gemv_add(qkv[:, :q_size], w["o"], x)
            act, _ = ops.gemv_norm_swiglu(x, None, w["post_norm"], 1e-6, w["gate_up"])
            x = ops.gemv_add(act, w["down"], x)
        return ops.gemv_norm(x, None, final_norm, 1e-6, lm_head)[0] if with_head else x

    layer_bytes = sum(t.numel() * 2 for k, t in stack[0].items() if k in ("qkv", "o", "gate_up", "down"))
    times = []
    for with_head in (False, True):
        step(with_head)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(with_head)
        times.append(replay_us(graph, reps))
    layers_us, total_us = times
    head_us = total_us - layers_us
    print(f"{name}: {layers_us / layers:6.2f} us a layer ({layers * layer_bytes / layers_us / 1e6:.2f} TB/s), "
          f"the LM head {head_us:6.1f} us ({lm_head.numel() * 2 / head_us / 1e6:.2f} TB/s)")


def main() -> None:
    ops = CudaOps()
    torch.manual_seed(0)
    for name in SHAPES:
        chain(ops, name)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
