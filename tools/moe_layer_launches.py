"""Each launch of a MoE layer's batch-1 decode step alone, and the whole layer, on a GPU (figures,
no asserts). Qwen3-30B-A3B's shapes by default:

    python -m tools.moe_layer_launches                # context 600
    python -m tools.moe_layer_launches --context 4096
    python -m tools.moe_layer_launches --experts 512 --inter 512 --top-k 10 --shared 512 --layers 24 \
        --heads 16 --kv-heads 2 --head-dim 256  # Qwen3-Next's
    python -m tools.moe_layer_launches --hidden 4096 --kv-heads 8 --dense 12288 --layers 36  # Qwen3-8B's
    python -m tools.moe_layer_launches --hidden 4096 --kv-heads 8 --dense 12288 --layers 36 \
        --context 32768 --kv-cache-dtype turbo4  # its layer over a 32k turbo4 cache
    python -m tools.moe_layer_launches --attention-splits 6  # the decode split 6 ways, not by the rule
    python -m tools.moe_layer_launches --carveout 50  # every kernel asks for half an SM's most shared memory

Every launch runs ``--layers`` times on distinct random weights (so a launch does not find its
weights in L2 from the one before), replayed from one CUDA graph; the figure is µs per launch.
"whole layer" chains them as the decoder's batch-1 path does: gemv_norm (q/k/v), the fused
decode attention, gemv_add (o_proj and the residual), the MoE FFN's row (moe_norm_route,
moe_routed; a shared expert folded in, as the model runs it). With
``--shared N`` the MoE FFN has a shared expert of width N (Qwen2-MoE, Qwen3-Next), and the lines
"MoE FFN" (the layers' ``MoeFfn.add_row``: without it, with it run apart, with it folded into the
routed experts as the cuda backend runs it) give what the shared expert costs. With ``--dense N``
the layer's FFN is a dense SwiGLU of width N instead (a dense model's batch-1 path). With ``--gdn``
the mixer is a Gated DeltaNet instead of the attention (Qwen3-Next's 27 linear-attention layers of
36: ``--gdn --experts 512 --inter 512 --top-k 10 --shared 512``).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from metrale_cli.kernels import cuda_attention
from metrale_cli.kernels.cases import kv_to, rope_decode_args, rope_decode_case
from metrale_cli.kernels.cuda_ops import CudaOps
from metrale_cli.kernels.ops import GdnTensors
from metrale_cli.layers.ffn import DenseSwiGluFfn
from metrale_cli.layers.moe import MoeFfn
from metrale_cli.layers.spec import MoeSpec
from metrale_cli.kernels.table import TC_MAX_SPLITS
from tools.gemv_chain import replay_us


def _time(fn, layers: int, replays: int = 30) -> float:
    for layer in range(layers):  # kernels loaded before the capture
        fn(layer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    return replay_us(graph, replays) / layers


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--kv-cache-dtype", default="bf16", help="the attention's KV-cache dtype (any of the 16)")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--shared", type=int, default=0, help="a shared expert of this width (0: none)")
    p.add_argument("--dense", type=int, default=0,
                   help="a dense SwiGLU FFN of this width in place of the MoE (Qwen3-8B: 12288)")
    p.add_argument("--gdn", action="store_true",
                   help="a Gated DeltaNet mixer in place of the attention (Qwen3-Next's linear-attention layers)")
    p.add_argument("--gdn-k-heads", type=int, default=16, help="its key heads")
    p.add_argument("--gdn-v-heads", type=int, default=32, help="its value heads")
    p.add_argument("--gdn-head-dim", type=int, default=128, help="its key and value heads' dim")
    p.add_argument("--gdn-taps", type=int, default=4, help="its causal conv's taps")
    p.add_argument("--attention-splits", type=int, default=0,
                   help=f"the one-launch decode's context splits, 1 to {TC_MAX_SPLITS} (0: the split rule's)")
    p.add_argument("--carveout", type=carveout, default=None,
                   help="every kernel asks for this shared-memory carveout, 0-100 percent (default: the driver's)")
    return p


def carveout(text: str) -> int:
    """--carveout's percent of an SM's most shared memory, 0 to 100."""
    value = int(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"--carveout must be 0 to 100 (percent), got {value}")
    return value


def force_attention_splits(splits: int) -> None:
    """Every tensor-core decode launch built after this splits its context ``splits`` ways instead
    of by the split rule (cuda_attention.tc_decode_splits), for an A/B of the rule."""
    if not 1 <= splits <= TC_MAX_SPLITS:
        raise SystemExit(f"--attention-splits must be 1 to {TC_MAX_SPLITS}, got {splits}")
    cuda_attention.tc_decode_splits = lambda device, ctas, max_blocks, tc: splits


def forced(a: argparse.Namespace) -> str:
    """What the run forces beside the shape, for the tools' headers ('' when nothing)."""
    return ((f", the attention split {a.attention_splits} ways" if a.attention_splits else "")
            + (f", every kernel at a {a.carveout}% carveout" if a.carveout is not None else ""))


def mixer_name(a: argparse.Namespace) -> str:
    """The layer's mixer in words, for the tools' headers."""
    if a.gdn:
        return f"a Gated DeltaNet of {a.gdn_k_heads} / {a.gdn_v_heads} heads of {a.gdn_head_dim}"
    return f"{a.heads} heads on {a.kv_heads} KV heads of {a.head_dim}"


def _gdn(a: argparse.Namespace, ops: CudaOps, rand, x, residual, gamma, dev: str):
    """A Gated DeltaNet mixer's launches alone, and the layer up to the residual after its
    out-projection as GatedDeltaNetLayer runs a row: norm + in-projection, the mixer over one
    sequence's state at position ``--context``, out-projection + the residual."""
    hk, hv, dk, taps, h, n = a.gdn_k_heads, a.gdn_v_heads, a.gdn_head_dim, a.gdn_taps, a.hidden, a.layers
    conv_dim, value_dim = 2 * hk * dk + hv * dk, hv * dk
    widths = [conv_dim, value_dim, hv, hv]  # [q; k; v], z, b, a
    f32 = dict(device=dev, dtype=torch.float32)
    in_w = [rand(sum(widths), h) for _ in range(n)]
    out_w = [rand(h, value_dim) for _ in range(n)]
    mixers = [GdnTensors(rand(conv_dim, taps) * 10, -torch.rand(hv, **f32), torch.rand(hv, **f32),
                         torch.ones(dk, device=dev, dtype=torch.bfloat16), 1e-6, hk,
                         torch.zeros(2, taps, conv_dim, **f32), torch.randn(2, hv, dk, dk, **f32) * 0.1)
              for _ in range(n)]
    slots = torch.zeros(1, dtype=torch.int32, device=dev)
    positions = torch.full((1,), a.context, dtype=torch.int32, device=dev)
    parts, mixed_out = rand(1, sum(widths)).split(widths, -1), rand(1, value_dim)

    def mix(i):
        projected, stream = ops.gemv_norm(x, residual, gamma, 1e-6, in_w[i])
        out = ops.gdn_decode(*projected.split(widths, -1), mixers[i], slots, positions)
        return ops.gemv_add(out, out_w[i], stream)

    return mix, {
        "in-proj gemv_norm": lambda i: ops.gemv_norm(x, residual, gamma, 1e-6, in_w[i]),
        "gdn decode": lambda i: ops.gdn_decode(*parts, mixers[i], slots, positions),
        "out-proj gemv_add": lambda i: ops.gemv_add(mixed_out, out_w[i], residual),
    }


def _attention(a: argparse.Namespace, ops: CudaOps, rand, x, residual, gamma, dev: str):
    """The attention's launches alone (q/k/v, the one-launch decode over a ``--context`` cache,
    o_proj), and the layer up to the residual after o_proj, as the decoder runs a row."""
    h, hq, hk, d, n = a.hidden, a.heads, a.kv_heads, a.head_dim, a.layers
    qkv_w = [rand((hq + 2 * hk) * d, h) for _ in range(n)]
    o_w = [rand(h, hq * d) for _ in range(n)]
    case = rope_decode_case([a.context], hq, hk, d, a.kv_cache_dtype, seed=1)
    attention = ops.paged_attention(case["kv"].dtype, d)
    args = [list(rope_decode_args(case, kv_to(case["kv"], dev), dev)) for _ in range(4)]
    o_in = rand(1, hq * d)

    def attend(i):
        qkv, s = ops.gemv_norm(x, residual, gamma, 1e-6, qkv_w[i])
        q, kk, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        out = attention.rope_cache_decode(q.view(1, hq, d), kk.view(1, hk, d), v.view(1, hk, d), *args[i % 4][3:])
        return ops.gemv_add(out.reshape(1, -1), o_w[i], s)

    return attend, {
        "qkv gemv_norm": lambda i: ops.gemv_norm(x, residual, gamma, 1e-6, qkv_w[i]),
        "attention": lambda i: attention.rope_cache_decode(*args[i % 4]),
        "o gemv_add": lambda i: ops.gemv_add(o_in, o_w[i], residual),
    }


def build(a: argparse.Namespace, ops: CudaOps, dev: str = "cuda") -> dict:
    """The shape's random weights, one per layer, and the launches to time: name -> fn(layer)
    (``ops`` and ``dev``: the torch reference on the CPU too, as the tests build them)."""
    h, e, inter, k, n = a.hidden, a.experts, a.inter, a.top_k, a.layers
    if a.attention_splits:
        force_attention_splits(a.attention_splits)
    if a.carveout is not None:
        ops.loader.carveout = a.carveout
    torch.manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16) * 0.02

    gamma = torch.ones(h, device=dev, dtype=torch.bfloat16)
    x, residual = rand(1, h) * 50, rand(1, h) * 50
    attend, launches = (_gdn if a.gdn else _attention)(a, ops, rand, x, residual, gamma, dev)
    if a.dense:
        ffn = [DenseSwiGluFfn(rand(2 * a.dense, h), rand(h, a.dense), ops) for _ in range(n)]
        launches["dense FFN (DenseSwiGluFfn.add_row)"] = lambda i: ffn[i].add_row(residual, gamma, 1e-6)
        launches["whole layer"] = lambda i: ffn[i].add_row(attend(i), gamma, 1e-6)
        return launches
    router = [rand(e, h) for _ in range(n)]
    gate_up = [rand(e, 2 * inter, h) for _ in range(n)]
    down = [rand(e, h, inter) for _ in range(n)]
    logits = rand(1, e)
    read = torch.zeros(1, dtype=torch.long, device=dev)

    def layer(i):  # the MoE FFN as the model runs it: a shared expert folded into the routed launches
        return (folded or plain)[i].add_row(attend(i), gamma, 1e-6)

    def unfused_router(i):
        normed = ops.rms_norm(residual, gamma, 1e-6)
        return ops.moe_route(F.linear(normed, router[i]), k, True)

    spec = MoeSpec(num_experts=e, top_k=k, expert_size=inter, norm_topk_prob=True, shared_expert_size=a.shared)
    plain = [MoeFfn(spec, router[i], gate_up[i], down[i], ops) for i in range(n)]
    shared_w = [(DenseSwiGluFfn(rand(2 * a.shared, h), rand(h, a.shared), ops), rand(1, h))
                for _ in range(n)] if a.shared else []
    apart = [MoeFfn(spec, router[i], gate_up[i], down[i], ops, *shared_w[i], fold_shared=False)
             for i in range(len(shared_w))]
    folded = [MoeFfn(spec, router[i], gate_up[i], down[i], ops, *shared_w[i], fold_shared=True)
              for i in range(len(shared_w))]
    launches |= {
        "rms_norm + router GEMM + moe_route": unfused_router,
        "moe_router_bf16": lambda i: ops.moe_norm_route(residual, gamma, 1e-6, router[i], k, True, read),
        "route + experts": lambda i: ops.moe(x, logits, gate_up[i], down[i], k, True, residual, read),
        "whole layer": layer,
        "MoE FFN (MoeFfn.add_row)": lambda i: plain[i].add_row(residual, gamma, 1e-6),
    }
    if shared_w:
        launches[f"... with a shared expert of {a.shared} apart"] = lambda i: apart[i].add_row(residual, gamma, 1e-6)
        launches[f"... with it folded ({folded[0].shared_slots} chunks)"] = \
            lambda i: folded[i].add_row(residual, gamma, 1e-6)
    return launches


def main() -> None:
    a = parser().parse_args()
    launches = build(a, CudaOps())
    ffn = (f"a dense FFN of {a.dense}" if a.dense else f"{a.experts} experts of {a.inter} (top {a.top_k})"
           + (f", a shared expert of {a.shared}" if a.shared else ""))
    print(f"batch-1 decode layer, hidden {a.hidden}, {mixer_name(a)}, {ffn}, context {a.context} ({a.kv_cache_dtype}), "
          f"{a.layers} layers{forced(a)}")
    for name, fn in launches.items():
        print(f"  {name:36s} {_time(fn, a.layers):7.2f} µs")


if __name__ == "__main__":
    main()
