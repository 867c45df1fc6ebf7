"""Torch references of every kernel: the oracle for kernel tests and the ``torch`` backend.

Plain and readable on purpose. Norms and RoPE reproduce HF transformers' rounding order in the
model dtype so the torch backend tracks HF token for token; attention upcasts to fp32. The
cache write and read of every side type are the codecs of ``kv/formats.py`` + ``kv/quant.py``
(the normative bytes); attention sees the values as stored, in the rotated basis for a rotated
side (the layer rotates Q and the output, see ``layers/attention.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale_cli.kernels import gdn_reference
from metrale_cli.kernels.ops import MoeRoute, StepBuffers
from metrale_cli.kernels.rotation import restore_output, rotate_query
from metrale_cli.kv import formats
from metrale_cli.kv.dtypes import KvCacheDtype
from metrale_cli.kv.pool import BLOCK_SIZE, LayerKv, SidePool
from metrale_cli.kv.wht import wht_inplace, wht_signs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return rms_norm(s, weight, eps), s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q, k, positions, cos, sin):
    rot = cos.shape[-1] * 2
    pos = positions.long()
    c = torch.cat((cos[pos], cos[pos]), dim=-1).to(q.dtype).unsqueeze(1)  # (T, 1, rot)
    s = torch.cat((sin[pos], sin[pos]), dim=-1).to(q.dtype).unsqueeze(1)

    def apply(x):
        xr, xp = x[..., :rot], x[..., rot:]
        return torch.cat((xr * c + _rotate_half(xr) * s, xp), dim=-1)

    return apply(q), apply(k)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def reshape_and_cache(k, v, kv: LayerKv, slot_mapping) -> None:
    formats.store(k, kv.k, slot_mapping)
    formats.store(v, kv.v, slot_mapping)


def rope_and_cache(q, k, v, kv: LayerKv, slot_mapping, positions, cos, sin, q_norm, k_norm, eps, rotate_q=False):
    """The unfused sequence: QK-norm per head, RoPE, cache write; returns q (rotated into the K
    side's basis with ``rotate_q``)."""
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
    q, k = rope(q, k, positions, cos, sin)
    reshape_and_cache(k, v, kv, slot_mapping)
    return rotate_query(TorchOps, q, kv.k) if rotate_q else q


def rope_cache_decode(q, k, v, kv: LayerKv, slot_mapping, positions, cos, sin, q_norm, k_norm, eps, block_tables,
                      seq_lens, scale):
    """A decode step's attention: :func:`rope_and_cache` (``rotate_q``), then :func:`paged_decode`
    (``restore_v``)."""
    q = rope_and_cache(q, k, v, kv, slot_mapping, positions, cos, sin, q_norm, k_norm, eps, rotate_q=True)
    return paged_decode(q, kv, block_tables, seq_lens, scale, restore_v=True)


def gather_context(pool: SidePool, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached positions of one sequence, dequantized: (length, Hk, D) fp32."""
    return formats.load(pool, block_table, length)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask) -> torch.Tensor:
    """q: (T, Hq, D), k/v: (S, Hk, D) fp32; mask: (T, S) bool of allowed positions or None."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, v).to(q.dtype)


def paged_decode(q, kv: LayerKv, block_tables, seq_lens, scale, restore_v=False):
    out = torch.zeros_like(q)  # an empty context attends to nothing: zeros, as the kernels write
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        k = gather_context(kv.k, block_tables[b], length)
        v = gather_context(kv.v, block_tables[b], length)
        out[b] = attention(q[b : b + 1], k, v, scale, None)[0]
    return restore_output(TorchOps, out, kv.v) if restore_v else out


def paged_prefill(q, kv: LayerKv, block_table, start_pos, scale):
    total = start_pos + q.shape[0]
    k = gather_context(kv.k, block_table, total)
    v = gather_context(kv.v, block_table, total)
    qpos = torch.arange(start_pos, total, device=q.device)[:, None]
    kpos = torch.arange(total, device=q.device)[None, :]
    return attention(q, k, v, scale, kpos <= qpos)


def gemv_norm(x, residual, norm_weight, eps, weight):
    s = x if residual is None else (x + residual).to(x.dtype)
    return F.linear(rms_norm(s, norm_weight, eps), weight), s


def gemv_norm_logits(x, residual, norm_weight, eps, weight):
    return gemv_norm(x, residual, norm_weight, eps, weight)[0].float()


def gemv_norm_swiglu(x, residual, norm_weight, eps, gate_up):
    y, s = gemv_norm(x, residual, norm_weight, eps, gate_up)
    return silu_and_mul(y), s


def gemv_add(x, weight, residual, gate=None):
    y = F.linear(x if gate is None else x * torch.sigmoid(gate), weight)
    return y if residual is None else residual + y


def decode_advance(logits, step: StepBuffers, rows: int) -> None:
    nxt, tokens, pos, lens, slots, live, tables = (
        t[:rows] for t in (step.next_tokens, step.tokens, step.positions, step.seq_lens, step.slots, step.live,
                           step.tables))
    if logits is not None:
        nxt.copy_(logits[:rows].argmax(dim=-1))
    tokens.copy_(nxt)
    pos += live
    lens += live
    index = torch.clamp(pos // BLOCK_SIZE, max=tables.shape[1] - 1).long()
    block = tables.gather(1, index[:, None])[:, 0]
    slots.copy_(torch.where(live.bool(), block * BLOCK_SIZE + pos % BLOCK_SIZE, -1))


def moe_route(logits, top_k, normalize, shared=0):
    routed = logits[:, :logits.shape[1] - (shared > 0)]
    probs = torch.softmax(routed, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if shared:  # the shared expert's chunks, after the routed experts, weighted sigmoid(its gate)
        rows, experts = routed.shape
        chunks = torch.arange(experts, experts + shared, device=ids.device).expand(rows, shared)
        gate = torch.sigmoid(logits[:, experts:].float()).expand(rows, shared)
        ids, weights = torch.cat([ids, chunks], dim=1), torch.cat([weights, gate], dim=1)
    return ids.to(torch.int32), weights


def moe_experts(x, ids, weights, gate_up, down, residual=None):
    """HF transformers' expert loop: each expert some row chose, in ascending order, over the rows
    that chose it; each row's sum in that order. Syncs with the device (a reference)."""
    out = torch.zeros_like(x)
    w = weights.to(x.dtype)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * w[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out if residual is None else residual + out


def count_experts(ids, num_experts, experts_read) -> None:
    """experts_read += the number of distinct experts in ``ids``, with no host sync."""
    hit = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    experts_read += hit.index_fill_(0, ids.flatten().long(), 1).sum()


def shared_chunks(gate_up, down, shared):
    """gate_up and down with a :class:`SharedExpert`'s chunks stacked after the routed experts
    (copies: a reference's layout of what the kernels read in place)."""
    if shared is None:
        return gate_up, down
    experts, inter2, hidden = gate_up.shape
    inter, width = inter2 // 2, shared.width
    chunks = shared.chunks(inter)
    pad = chunks * inter - width
    gate, up = (F.pad(w, (0, 0, 0, pad)).view(chunks, inter, hidden) for w in shared.gate_up.split(width))
    down_chunks = F.pad(shared.down, (0, pad)).view(hidden, chunks, inter).transpose(0, 1)
    return torch.cat([gate_up, torch.cat([gate, up], dim=1)]), torch.cat([down, down_chunks])


def moe(x, logits, gate_up, down, top_k, normalize, residual, experts_read, shared=None):
    gate_up, down = shared_chunks(gate_up, down, shared)
    slots = 0 if shared is None else shared.chunks(gate_up.shape[1] // 2)
    ids, weights = moe_route(logits, top_k, normalize, slots)
    if experts_read is not None:  # the routed experts (a shared expert is read whole every call)
        count_experts(ids[:, :top_k], gate_up.shape[0], experts_read)
    return moe_experts(x, ids, weights, gate_up, down, residual)


def moe_norm_route(h, norm_weight, eps, router, top_k, normalize, experts_read, shared=0):
    x = rms_norm(h, norm_weight, eps)
    ids, weights = moe_route(F.linear(x, router), top_k, normalize, shared)
    if experts_read is not None:
        count_experts(ids[:, :top_k], router.shape[0], experts_read)
    return x, MoeRoute(ids, weights)


def moe_routed(x, route, gate_up, down, residual, shared=None):
    gate_up, down = shared_chunks(gate_up, down, shared)
    return moe_experts(x, route.ids, route.weights, gate_up, down, residual)


class TorchPagedAttention:
    """The references of :class:`~metrale_cli.kernels.ops.PagedAttention`: the codecs of
    ``kv/formats.py`` serve every dtype, so only a rotated side's head_dim is checked."""

    reshape_and_cache = staticmethod(reshape_and_cache)
    rope_and_cache = staticmethod(rope_and_cache)
    paged_decode = staticmethod(paged_decode)
    rope_cache_decode = staticmethod(rope_cache_decode)
    paged_prefill = staticmethod(paged_prefill)

    def __init__(self, dtype: KvCacheDtype, head_dim: int):
        if dtype.row.rotated:
            wht_signs(head_dim)  # refuses a head_dim the rotation does not serve
        self.dtype, self.head_dim = dtype, head_dim


class TorchOps:
    """The pure-torch backend: runs on CPU or GPU."""

    name = "torch"
    moe_folds_shared = False
    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rope = staticmethod(rope)
    silu_and_mul = staticmethod(silu_and_mul)
    linear = staticmethod(F.linear)
    gemv_norm = staticmethod(gemv_norm)
    gemv_norm_logits = staticmethod(gemv_norm_logits)
    gemv_norm_swiglu = staticmethod(gemv_norm_swiglu)
    gemv_add = staticmethod(gemv_add)
    decode_advance = staticmethod(decode_advance)
    moe_route = staticmethod(moe_route)
    moe = staticmethod(moe)
    moe_norm_route = staticmethod(moe_norm_route)
    moe_routed = staticmethod(moe_routed)
    gdn_decode = staticmethod(gdn_reference.decode)
    gdn_prefill = staticmethod(gdn_reference.prefill)

    @staticmethod
    def paged_attention(dtype: KvCacheDtype, head_dim: int) -> TorchPagedAttention:
        return TorchPagedAttention(dtype, head_dim)

    @staticmethod
    def linear_silu_and_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(F.linear(x, gate_up))

    @staticmethod
    def gemv_fits(k: int, dtype: torch.dtype) -> bool:
        """Never: the torch backend runs the unfused sequence the fused GEMVs are checked against."""
        return False

    @staticmethod
    def wht(x: torch.Tensor, signs: torch.Tensor, inverse: bool) -> torch.Tensor:
        return wht_inplace(x, signs, inverse)
