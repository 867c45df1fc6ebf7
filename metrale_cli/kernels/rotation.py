"""The WHT bookends of rotated KV sides, over any backend's ``wht`` (:meth:`Ops.wht`): a rotated
K side scores against the query in its basis, a rotated V side gives the attention output in its
basis. The cuda backend fuses both into neighbouring launches (rope_and_cache's ``rotate_q``,
the split combine's ``restore_v``) with these functions' bytes.
"""

from __future__ import annotations

import torch

from metrale_cli.kv.pool import SidePool


def rotate_query(ops, q: torch.Tensor, k_pool: SidePool) -> torch.Tensor:
    """q: (T, Hq, D) -> the query the kernels expect for ``k_pool``: R·q / channel_scale when the
    K side is rotated (query head h divided by the scales of KV head h // (Hq // Hk)), else q."""
    if not k_pool.rotated:
        return q
    tokens, hq, d = q.shape
    q = ops.wht(q.reshape(-1, d).contiguous(), k_pool.signs, False).view(tokens, hq, d)
    if k_pool.channel_scale is not None:
        hk = k_pool.num_kv_heads
        grouped = q.view(tokens, hk, hq // hk, d).float() / k_pool.channel_scale[None, :, None, :]
        q = grouped.to(q.dtype).view(tokens, hq, d)
    return q


def restore_output(ops, out: torch.Tensor, v_pool: SidePool) -> torch.Tensor:
    """out: (T, Hq, D) in the V side's basis -> the original basis (Rᵀ·out when V is rotated)."""
    if not v_pool.rotated:
        return out
    tokens, hq, d = out.shape
    return ops.wht(out.reshape(-1, d).contiguous(), v_pool.signs, True).view(tokens, hq, d)
