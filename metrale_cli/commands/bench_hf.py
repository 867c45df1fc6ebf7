"""HF transformers on the same weights, timed the same way (eager, dynamic cache, greedy)."""

from __future__ import annotations

import statistics

import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.reference import count_experts


def hf_model(raw: dict, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise MetraleError("--compare-hf needs the transformers package",
                           hint="pip install transformers") from None
    from metrale_cli.models import family_of, model_config

    canonical = family_of(raw.get("model_type")).canonical
    if canonical is not None:  # transformers 5's own names (a MoE's experts stacked), as its modules hold them
        tensors = dict(tensors)
        canonical(model_config(raw), tensors)
    cfg = AutoConfig.for_model(**raw)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise MetraleError(f"HF model does not take these weights: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


class RoutedExperts:
    """Counts, on the device, the distinct experts each MoE router of an HF model chooses per call
    (a forward hook on every ``*TopKRouter``, whose output ends with the chosen indices)."""

    def __init__(self, model):
        self.count = None
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _hook(self, router, args, output):
        if self.count is None:
            self.count = torch.zeros(1, dtype=torch.long, device=output[-1].device)
        count_experts(output[-1], router.num_experts, self.count)

    def total(self) -> int:
        return 0 if self.count is None else int(self.count)


@torch.inference_mode()
def _time_hf(model, opts, device, seed: int, routed: RoutedExperts) -> tuple[float, float, float]:
    from metrale_cli.commands.timing import Timer

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (opts.batch, opts.n_prompt), generator=gen).to(device)
    with Timer(device) as t_pp:
        out = model(ids[:1], use_cache=True)
    out = model(ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    chosen = routed.total()
    with Timer(device) as t_tg:
        for _ in range(opts.n_gen):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            token.tolist()
    return t_pp.seconds, t_tg.seconds / opts.n_gen, (routed.total() - chosen) / opts.n_gen


def bench_hf(raw: dict, tensors: dict[str, torch.Tensor], opts, device: torch.device,
             peak: float | None) -> list[dict]:
    from metrale_cli.commands.timing import timing_row
    from metrale_cli.models import model_config

    dtype = next(iter(tensors.values())).dtype
    model = hf_model(raw, tensors, device, dtype)
    routed = RoutedExperts(model)
    _time_hf(model, opts, device, 0, routed)  # warm-up at the timed shapes
    runs = [_time_hf(model, opts, device, r + 1, routed) for r in range(opts.repetitions)]
    experts = {n: t for n, t in tensors.items() if ".mlp.experts." in n}
    weight_bytes = sum(t.numel() * t.element_size() for n, t in tensors.items() if n not in experts)
    routed_bytes = {}
    if experts:  # the routed experts a step read: one expert's bytes of one layer, times those chosen
        routers = routed.routers
        expert = sum(t.numel() * t.element_size() for t in experts.values()) // (len(routers) * routers[0].num_experts)
        routed_bytes = {"routed_bytes_per_step": expert * statistics.mean(r[2] for r in runs)}
        weight_bytes += routed_bytes["routed_bytes_per_step"]
    if "lm_head.weight" in tensors:  # untied: the input embedding is gathered a row per token
        embed = tensors["model.embed_tokens.weight"]
        weight_bytes -= embed.numel() * embed.element_size()
    layers = model_config(raw).layers
    kv_bytes = sum(2 * s.attention.kv_size * dtype.itemsize for s in layers if s.has_kv)  # K and V in HF's dtype
    state_bytes = sum(s.gdn.step_read_bytes() for s in layers if s.gdn is not None)  # the same state reads as ours
    step_bytes = weight_bytes + opts.batch * ((opts.n_prompt + opts.n_gen // 2) * kv_bytes + state_bytes)
    name = "HF transformers (eager)"
    return [
        timing_row(name, f"pp{opts.n_prompt}", [r[0] for r in runs], opts.n_prompt, None, peak),
        timing_row(name, f"tg{opts.n_gen} b{opts.batch} @{opts.n_prompt}", [r[1] for r in runs], opts.batch,
             step_bytes, peak) | routed_bytes,
    ]
