"""Torch references of the Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 ``linear_attention``).

Per value head the layer keeps a state S (Dk, Dv), fp32. Token t with key k_t and query q_t
(both L2-normalised, q scaled by Dk ** -0.5), value v_t, decay g_t <= 0 and rate beta_t in (0, 1):

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T        (the delta rule: write the correction)
    o_t = S^T q_t

:func:`recurrent_gated_delta_rule` runs that loop token by token (decode); :func:`chunked_gated_delta_rule`
computes the same outputs and final state a chunk of up to 64 tokens at a time in the WY / UT-transform
form (prefill), as HF transformers' ``torch_chunk_gated_delta_rule`` and FLA's kernels do. Both take
the state as a tensor they update in place, so a prefill chunk continues where the last one stopped.
Everything is computed in fp32; outputs are returned in the inputs' dtype.

:func:`decode` and :func:`prefill` are the torch backend's ``Ops.gdn_decode`` / ``Ops.gdn_prefill``:
the whole mixer between the in-projection and the out-projection (conv over the pooled window,
the rule over the pooled state, the gated norm), reading and writing a :class:`~metrale_cli.kernels.ops.GdnTensors`'
pools. The conv pool keeps the last K inputs of a sequence, the input at position p in entry p % K:
a decode step reads entries p-K+1 .. p-1 and writes entry p, so the kernel's CTAs that share a
channel's window never race.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale_cli.kernels.ops import GdnTensors

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x²) + eps) over the last dim (FLA's and HF's form), fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, divide: bool = False):
    """fp32, (B, H, T, ·) layout, q and k L2-normalised, q scaled by Dk ** -0.5 (``divide``: as
    q / Dk ** 0.5, HF's recurrent form; the two round differently unless Dk is a power of 4)."""
    q, k = l2_normalize(q), l2_normalize(k)
    q = q / q.shape[-1] ** 0.5 if divide else q * q.shape[-1] ** -0.5
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    return q, k, v, g.float().transpose(1, 2), beta.float().transpose(1, 2)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The token-by-token form. q, k: (B, T, H, Dk); v: (B, T, H, Dv); g, beta: (B, T, H);
    state: (B, H, Dk, Dv) fp32, updated in place -> out (B, T, H, Dv) in v's dtype. q and k are
    raw (normalised here); H is the value heads (key heads already repeated to them)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, divide=True)
    s = state.float()
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        s = s * g[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", s, k[:, :, t])
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, :, t])
    state.copy_(s)
    return out.transpose(1, 2).to(dtype)


def _chunk(q, k, v, g, beta, s):
    """One chunk of L tokens, (B, H, L, ·) fp32, from state s -> (out (B, H, L, Dv), new state).

    With c = cumsum(g) and D[i, j] = exp(c_i - c_j) for j <= i: the corrections u the delta rule
    writes solve (I + A) u = beta * (v - exp(c) * K S), A[i, j] = beta_i (k_i . k_j) D[i, j] for
    j < i (unit lower-triangular: one triangular solve, the UT transform). Then
    o = exp(c) * Q S + (Q K^T * D) u and S' = exp(c_L) S + sum_j exp(c_L - c_j) k_j u_j^T."""
    length = q.shape[2]
    c = g.cumsum(dim=-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: unitriangular
    rhs = v * beta[..., None] - (k_beta * c.exp()[..., None]) @ s
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = (q * c.exp()[..., None]) @ s + ((q @ k.transpose(-1, -2)) * decay) @ u
    tail = (c[..., -1:] - c).exp()[..., None]
    s = s * c[..., -1].exp()[..., None, None] + (k * tail).transpose(-1, -2) @ u
    return out, s


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The chunked (WY) form of :func:`recurrent_gated_delta_rule`, same contract: chunks of
    ``chunk`` tokens, the last one shorter (no padding)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float()
    out = torch.empty_like(v)
    for start in range(0, q.shape[2], chunk):
        part = slice(start, start + chunk)
        out[:, :, part], s = _chunk(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], beta[:, :, part], s)
    state.copy_(s)
    return out.transpose(1, 2).to(dtype)


def causal_conv1d(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The depthwise causal conv + SiLU of one sequence. x: (T, C); window: (K-1, C) fp32, the
    inputs before x (zeros at the sequence start), updated in place to the last K-1 inputs;
    weight: (C, K) -> (T, C) in x's dtype."""
    taps = weight.shape[1]
    padded = torch.cat([window, x.float()])  # (K-1+T, C)
    out = F.conv1d(padded.t()[None], weight.float()[:, None, :], groups=weight.shape[0])[0].t()
    window.copy_(padded[-(taps - 1):])
    return F.silu(out).to(x.dtype)


def causal_conv1d_step(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One new input per sequence. x: (B, C); windows: (B, K-1, C) fp32 -> (B, C) in x's dtype,
    and the updated windows (B, K-1, C) (returned: the caller scatters them back)."""
    full = torch.cat([windows, x.float()[:, None]], dim=1)  # (B, K, C)
    out = torch.einsum("bkc,ck->bc", full, weight.float())
    return F.silu(out).to(x.dtype), full[:, 1:]


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3NextRMSNormGated: weight * rms_norm(x) (rounded to x's dtype first) * silu(z),
    in fp32, cast to x's dtype once. x, z: (N, Dv); weight: (Dv,)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


# --- the mixer over pooled state (Ops.gdn_decode / Ops.gdn_prefill) -------------------------------
def _window_entries(positions: torch.Tensor, taps: int) -> torch.Tensor:
    """(B,) positions p -> (B, taps - 1) conv-pool entries of positions p-taps+1 .. p-1, oldest first."""
    offsets = torch.arange(1 - taps, 0, device=positions.device)
    return (positions.long()[:, None] + offsets) % taps


def mix(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer: GdnTensors,
        state: torch.Tensor, rule) -> torch.Tensor:
    """After the conv: mixed (B, T, conv_dim) = [q; k; v], z (B*T, value_dim), b / a (B, T, Hv),
    state (B, Hv, Dk, Dv) fp32 (updated in place by ``rule``) -> the gated norm's output
    (B*T, value_dim) in mixed's dtype. Key heads are repeated to the value heads they serve."""
    rows, tokens = mixed.shape[:2]
    heads_v, dk, dv = state.shape[1:]
    heads_k = layer.num_k_heads
    q, k, v = mixed.split([heads_k * dk, heads_k * dk, heads_v * dv], -1)
    q, k = (t.reshape(rows, tokens, heads_k, dk).repeat_interleave(heads_v // heads_k, dim=2) for t in (q, k))
    v = v.reshape(rows, tokens, heads_v, dv)
    g = -layer.a_log.exp() * F.softplus(a.float() + layer.dt_bias)
    out = rule(q, k, v, g, b.sigmoid(), state)
    return gated_rms_norm(out.reshape(-1, dv), z.reshape(-1, dv), layer.norm, layer.eps).reshape(rows * tokens, -1)


def decode(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer: GdnTensors,
           slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row: mixed (B, conv_dim) (the in-projection's [q; k; v]), z (B, value_dim),
    b / a (B, Hv); row i continues pool slot ``slots[i]`` at position ``positions[i]`` -> (B,
    value_dim). No host sync: every index stays on the device."""
    taps = layer.conv.shape[1]
    rows = slots.long()
    windows = layer.conv_pool[rows[:, None], _window_entries(positions, taps)]  # (B, K-1, C)
    conv = torch.einsum("bkc,ck->bc", torch.cat([windows, mixed.float()[:, None]], dim=1), layer.conv.float())
    layer.conv_pool[rows, positions.long() % taps] = mixed.float()
    state = layer.recurrent_pool[rows]
    out = mix(F.silu(conv).to(mixed.dtype)[:, None], z, b[:, None], a[:, None], layer, state,
              recurrent_gated_delta_rule)
    layer.recurrent_pool[rows] = state
    return out


def prefill(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer: GdnTensors,
            slot: int, start_pos: int, rule=chunked_gated_delta_rule) -> torch.Tensor:
    """T tokens of one sequence at positions start_pos .. start_pos+T-1, continuing pool slot
    ``slot`` (zeroed by the caller at a sequence's start): mixed (T, conv_dim), z (T, value_dim),
    b / a (T, Hv) -> (T, value_dim), the chunked ``rule`` (this module's, or one with its contract).
    Reads nothing from the device on the host."""
    taps, tokens = layer.conv.shape[1], mixed.shape[0]
    pool = layer.conv_pool[slot]
    window = pool.roll(-((start_pos + 1) % taps), 0)[: taps - 1]  # positions start_pos-K+1 .. start_pos-1
    conv = causal_conv1d(mixed, window, layer.conv)  # window: now the last K-1 inputs
    last = torch.arange(start_pos + tokens - taps + 1, start_pos + tokens, device=pool.device) % taps
    pool[last] = window
    state = layer.recurrent_pool[slot : slot + 1]
    return mix(conv[None], z, b[None], a[None], layer, state, rule)
