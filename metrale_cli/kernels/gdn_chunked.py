"""The chunked gated delta rule with every chunk's own work batched (the cuda backend's prefill).

:func:`~metrale_cli.kernels.gdn_reference.chunked_gated_delta_rule` walks the chunks one by one,
each with a dozen small launches. Only one part of a chunk depends on the chunks before it: the
state it starts from. Here everything else runs for all chunks at once, as batched GEMMs:

- per chunk (cumulative decay c, D[i, j] = exp(c_i - c_j) for j <= i): the UT transform
  T = (I + A)^-1 with A = strictly-lower(beta k k^T * D), then W = T (beta k * exp(c)) and
  U = T (beta v), and the intra-chunk scores P = (q k^T) * D;
- the walk over the chunks: u_n = U_n - W_n S, then S <- exp(c_last) S + (k * exp(c_last - c))^T u_n,
  keeping each chunk's starting state (:func:`torch_walk`: three launches a chunk; the cuda backend
  passes ``kernels_cu/gdn_prefill.cu``'s one launch for all of them);
- then every chunk's output at once: o = P u + (q * exp(c)) S_start (two batched GEMMs).

Every chunk's own part is :func:`torch_prep` (a dozen launches); the cuda backend passes
``kernels_cu/gdn_prefill.cu``'s one launch in its place.

The math is the reference's (its docstring derives it); the sums run in another order, so the
two agree to fp32 rounding, not bit for bit. A last partial chunk is padded with tokens that
neither decay nor write (g = 0, beta = 0, k = q = 0), whose outputs are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale_cli.kernels.gdn_reference import CHUNK, _prepare


def torch_walk(w: torch.Tensor, u: torch.Tensor, k_tail: torch.Tensor, gamma: torch.Tensor, state: torch.Tensor,
               starts: torch.Tensor) -> None:
    """The walk over n chunks of BH (sequence, head) pairs, fp32: w (BH, n, L, Dk), u (BH, n, L, Dv)
    (U in, the corrections out), k_tail (BH, n, Dk, L), gamma (BH, n), state (BH, Dk, Dv) (the
    start in, the end out), starts (BH, n, Dk, Dv) (out: the state each chunk starts from)."""
    s = state.clone()
    for i in range(w.shape[1]):
        starts[:, i] = s
        u[:, i].baddbmm_(w[:, i], s, alpha=-1.0)
        s = torch.baddbmm(s * gamma[:, i, None, None], k_tail[:, i], u[:, i])
    state.copy_(s)


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK,
                             walk=torch_walk) -> torch.Tensor:
    """Same contract as ``gdn_reference.chunked_gated_delta_rule``: q, k (B, T, H, Dk), v (B, T, H,
    Dv), g, beta (B, T, H), state (B, H, Dk, Dv) fp32 updated in place -> (B, T, H, Dv) in v's dtype.
    ``walk``: :func:`torch_walk` or a function with its contract."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # (B, H, T, .) fp32
    batch, heads, tokens, dk = q.shape
    pad = -tokens % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    flat = [x.reshape(batch * heads, -1, x.shape[-1]) for x in (q, k, v)]
    flat += [x.reshape(batch * heads, -1) for x in (g, beta)]
    s = state.float().reshape(batch * heads, dk, v.shape[-1]).contiguous()
    out = chunks(*flat, s, chunk, walk)
    state.copy_(s.reshape(state.shape))
    return out.reshape(batch, heads, -1, v.shape[-1])[:, :, :tokens].transpose(1, 2).to(dtype)


def torch_prep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """Every chunk's own part, batched: q, k (BH, n, L, Dk), v (BH, n, L, Dv), g, beta (BH, n, L)
    fp32 -> (w (BH, n, L, Dk), u (BH, n, L, Dv), k_tail (BH, n, Dk, L), gamma (BH, n), scores (BH,
    n, L, L), q * exp(c) (BH, n, L, Dk)), all contiguous (the module docstring's forms). The cuda
    backend passes ``kernels_cu/gdn_prefill.cu``'s one launch with this contract."""
    chunk = q.shape[2]
    c = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # I + its strict lower part: the solve reads no more
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device).expand_as(system)
    t = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    w = t @ (k_beta * c.exp()[..., None])
    u = t @ (v * beta[..., None])
    scores = (q @ k.transpose(-1, -2)) * decay
    last = c[..., -1]
    k_tail = (k * (last[..., None] - c).exp()[..., None]).transpose(-1, -2)
    return (w.contiguous(), u.contiguous(), k_tail.contiguous(), last.exp().contiguous(), scores.contiguous(),
            (q * c.exp()[..., None]).contiguous())


def chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
           chunk: int = CHUNK, walk=torch_walk, prep=torch_prep) -> torch.Tensor:
    """The rule over prepared inputs (q L2-normalised and scaled, k L2-normalised; padded to whole
    chunks with tokens of g = beta = 0): q, k (BH, n*L, Dk), v (BH, n*L, Dv), g, beta (BH, n*L),
    fp32; state (BH, Dk, Dv) fp32 contiguous, updated in place -> out (BH, n*L, Dv) fp32.
    ``prep``: :func:`torch_prep` or a function with its contract (which may overwrite q)."""
    pairs, padded, dk = q.shape
    dv, n = v.shape[-1], padded // chunk
    q, k, v = (x.view(pairs, n, chunk, x.shape[-1]) for x in (q, k, v))
    w, u, k_tail, gamma, scores, qe = prep(q, k, v, g.view(pairs, n, chunk), beta.view(pairs, n, chunk))
    starts = torch.empty(pairs, n, dk, dv, dtype=q.dtype, device=q.device)
    walk(w, u, k_tail, gamma, state, starts)
    out = torch.bmm(scores.view(-1, chunk, chunk), u.view(-1, chunk, dv))
    out.baddbmm_(qe.view(-1, chunk, dk), starts.view(-1, dk, dv))
    return out.view(pairs, padded, dv)
