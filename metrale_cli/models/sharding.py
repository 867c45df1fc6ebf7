"""A tensor-parallel rank's shard of a model: its config (heads, widths, vocabulary rows divided)
and its part of every canonical HF-named tensor; what each rank holds is listed in
:mod:`metrale_cli.layers.parallel`."""

from __future__ import annotations

import dataclasses

import torch

from metrale_cli.config import ModelConfig
from metrale_cli.errors import MetraleError
from metrale_cli.layers.parallel import TensorParallel


# --- the shard of a config -----------------------------------------------------------------------
def _kv_heads(num_kv_heads: int, size: int) -> int:
    return max(1, num_kv_heads // size)


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Refuse, in one line, a model whose heads or widths do not split over ``size`` ranks."""
    problems = []

    def need(what: str, n: int) -> None:
        if n % size:
            problems.append(f"{what} ({n})")

    for s in cfg.layers:
        if s.attention is not None:
            a = s.attention
            need("attention heads", a.num_heads)
            if a.num_kv_heads >= size:
                need("KV heads", a.num_kv_heads)
            elif size % a.num_kv_heads:
                problems.append(f"KV heads ({a.num_kv_heads}: {size} ranks are not a multiple of them)")
        if s.gdn is not None:
            need("Gated DeltaNet key heads", s.gdn.num_k_heads)
        if s.ffn.moe is not None:
            need("expert width", s.ffn.moe.expert_size)
            if s.ffn.moe.shared_expert_size:
                need("shared expert width", s.ffn.moe.shared_expert_size)
        else:
            need("FFN width", s.ffn.intermediate_size)
    if problems:
        raise MetraleError(f"--tensor-parallel-size {size} does not divide the model's "
                           f"{', '.join(dict.fromkeys(problems))}",
                           hint="choose a size that divides them, or 1")


def shard_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The config of one rank's shard: heads, widths and vocabulary rows divided by ``tp.size``."""
    if tp.size == 1:
        return cfg
    check_shardable(cfg, tp.size)
    n = tp.size
    layers = []
    for s in cfg.layers:
        changes = {}
        if s.attention is not None:
            a = s.attention
            changes["attention"] = dataclasses.replace(a, num_heads=a.num_heads // n,
                                                       num_kv_heads=_kv_heads(a.num_kv_heads, n))
        if s.gdn is not None:
            g = s.gdn
            changes["gdn"] = dataclasses.replace(g, num_k_heads=g.num_k_heads // n, num_v_heads=g.num_v_heads // n)
        f = s.ffn
        if f.moe is not None:
            changes["ffn"] = dataclasses.replace(f, moe=dataclasses.replace(
                f.moe, expert_size=f.moe.expert_size // n, shared_expert_size=f.moe.shared_expert_size // n))
        else:
            changes["ffn"] = dataclasses.replace(f, intermediate_size=f.intermediate_size // n)
        layers.append(dataclasses.replace(s, **changes))
    return dataclasses.replace(cfg, layers=tuple(layers), vocab_rows=tp.vocab_rows(cfg.vocab_size))


# --- the shard of the tensors --------------------------------------------------------------------
def _part(n: int, tp: TensorParallel) -> slice:
    """Rank ``tp.rank``'s equal part of ``n`` (``n`` divisible by the size)."""
    k = n // tp.size
    return slice(tp.rank * k, (tp.rank + 1) * k)


def _heads(t: torch.Tensor, heads: int, part: slice, dim: int = 0) -> torch.Tensor:
    """Heads ``part`` of ``t``, whose dimension ``dim`` is ``heads`` equal blocks."""
    per = t.shape[dim] // heads
    return t.narrow(dim, part.start * per, (part.stop - part.start) * per)


def _sections(t: torch.Tensor, sizes: list[tuple[int, int]], tp: TensorParallel, dim: int = 0) -> torch.Tensor:
    """``t`` along ``dim`` is sections of (rows, heads): each section's part of its heads, in order."""
    out, at = [], 0
    for rows, heads in sizes:
        out.append(_heads(t.narrow(dim, at, rows), heads, _part(heads, tp), dim))
        at += rows
    return torch.cat(out, dim=dim)


def _kv_part(num_kv_heads: int, tp: TensorParallel) -> slice:
    if num_kv_heads >= tp.size:
        return _part(num_kv_heads, tp)
    head = tp.rank * num_kv_heads // tp.size
    return slice(head, head + 1)


def _vocab(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    rows = tp.vocab_rows(t.shape[0])
    part = t[tp.rank * rows:(tp.rank + 1) * rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], *t.shape[1:])])
    return part


def _layer_rules(spec, tp: TensorParallel) -> dict:
    """Name (under ``model.layers.N.``) -> the function giving this rank's part of the tensor."""
    rules = {"input_layernorm.weight": None, "post_attention_layernorm.weight": None}
    if spec.attention is not None:
        a = spec.attention
        q, kv = _part(a.num_heads, tp), _kv_part(a.num_kv_heads, tp)
        for side in ("weight", "bias"):
            rules[f"self_attn.q_proj.{side}"] = lambda t, q=q: _heads(t, a.num_heads, q)
            rules[f"self_attn.k_proj.{side}"] = rules[f"self_attn.v_proj.{side}"] = \
                lambda t, kv=kv: _heads(t, a.num_kv_heads, kv)
        rules["self_attn.o_proj.weight"] = lambda t: _heads(t, a.num_heads, q, dim=1)
        rules["self_attn.o_proj.bias"] = lambda t: t if tp.rank == 0 else torch.zeros_like(t)  # added once
        rules["self_attn.q_norm.weight"] = rules["self_attn.k_norm.weight"] = None
        rules["self_attn.qkv_proj.weight"] = lambda t: torch.cat([  # Phi-3's [q; k; v] rows, each cut as its own
            rules[f"self_attn.{n}_proj.weight"](rows) for n, rows in zip("qkv", t.split([a.q_size, a.kv_size, a.kv_size]))])
    if spec.gdn is not None:
        g, p = spec.gdn, "linear_attn."
        k, v = _part(g.num_k_heads, tp), _part(g.num_v_heads, tp)
        channels = [(g.key_dim, g.num_k_heads), (g.key_dim, g.num_k_heads), (g.value_dim, g.num_v_heads)]
        rules |= {
            p + "in_proj_qkvz.weight": lambda t: _heads(t, g.num_k_heads, k),  # grouped per key head
            p + "in_proj_ba.weight": lambda t: _heads(t, g.num_k_heads, k),
            p + "in_proj_qkv.weight": lambda t: _sections(t, channels, tp),
            p + "in_proj_z.weight": lambda t: _heads(t, g.num_v_heads, v),
            p + "in_proj_b.weight": lambda t: _heads(t, g.num_v_heads, v),
            p + "in_proj_a.weight": lambda t: _heads(t, g.num_v_heads, v),
            p + "conv1d.weight": lambda t: _sections(t, channels, tp),
            p + "dt_bias": lambda t: _heads(t, g.num_v_heads, v),
            p + "A_log": lambda t: _heads(t, g.num_v_heads, v),
            p + "norm.weight": None,
            p + "out_proj.weight": lambda t: _heads(t, g.num_v_heads, v, dim=1),
        }

    def swiglu(prefix: str, width: int) -> dict:
        w = _part(width, tp)
        return {prefix + "gate_proj.weight": lambda t: t[w], prefix + "up_proj.weight": lambda t: t[w],
                prefix + "down_proj.weight": lambda t: t[:, w],
                prefix + "gate_up_proj.weight": lambda t: torch.cat([half[w] for half in t.split(width)])}

    m = spec.ffn.moe
    if m is None:
        rules |= swiglu("mlp.", spec.ffn.intermediate_size)
    else:
        i, w = m.expert_size, _part(m.expert_size, tp)
        rules |= {"mlp.gate.weight": None,
                  "mlp.experts.gate_up_proj": lambda t: torch.cat([t[:, w], t[:, i + w.start:i + w.stop]], dim=1),
                  "mlp.experts.down_proj": lambda t: t[:, :, w]}
        for e in range(m.num_experts):  # a checkpoint's one tensor per expert, before they are stacked
            rules |= {f"mlp.experts.{e}.gate_proj.weight": lambda t: t[w], f"mlp.experts.{e}.up_proj.weight": lambda t: t[w],
                      f"mlp.experts.{e}.down_proj.weight": lambda t: t[:, w]}
        if m.shared_expert_size:
            rules |= swiglu("mlp.shared_expert.", m.shared_expert_size) | {"mlp.shared_expert_gate.weight": None}
    return rules


LANGUAGE_MODEL = "model.language_model."  # a vision-language checkpoint's text model (models/qwen3_5.py)


class Sharder:
    """Rank ``tp.rank``'s part of each tensor of a checkpoint of ``cfg`` (the unsharded config),
    one tensor at a time as the loader reads it (``transform(name, tensor)``), so a rank never
    holds more of the model than its shard and the tensor being read. It knows the canonical HF
    names (experts stacked) and the checkpoints' own forms of them (one tensor per expert, a
    vision-language checkpoint's ``model.language_model.`` prefix); a tensor it does not know is
    passed on whole, for the family's build to use or refuse as unexpected."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        from metrale_cli.models import family_of

        self.tp = tp
        self.expected = family_of(cfg.family).expected_tensors(cfg)
        self.rules = {"model.embed_tokens.weight": lambda t: _vocab(t, tp), "lm_head.weight": lambda t: _vocab(t, tp),
                      "model.norm.weight": None}
        for spec in cfg.layers:
            self.rules |= {f"model.layers.{spec.index}.{name}": rule for name, rule in _layer_rules(spec, tp).items()}
        unruled = sorted(set(self.expected) - set(self.rules))
        if unruled:  # every weight the build reads is sharded or replicated on purpose
            raise MetraleError(f"tensor parallelism has no rule to shard tensor {unruled[0]}",
                               hint="run this model with --tensor-parallel-size 1")

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        key = "model." + name.removeprefix(LANGUAGE_MODEL) if name.startswith(LANGUAGE_MODEL) else name
        rule = self.rules.get(key)
        if rule is None:
            return tensor
        want = self.expected.get(key)
        if want is not None and tuple(tensor.shape) != want:
            raise MetraleError(f"tensor {name} has shape {tuple(tensor.shape)}, config.json implies {want}")
        return rule(tensor).contiguous().clone()  # not a view: the full tensor can go

