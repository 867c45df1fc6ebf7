"""``metrale bench --kv-quality``: how much each KV dtype changes a model's next-token predictions.

The corpus (the shipped English prose unless ``--corpus``) is cut into windows of ``window``
tokens; each window is run teacher-forced through the model, chunked prefill writing and reading
the KV cache, once with bf16 KV (the reference) and once per dtype. Per dtype: the mean
KL(P_bf16 ‖ P_dtype) of the next-token distributions, the perplexity of the corpus and its change
against bf16, and top-1 agreement. Each dtype is measured twice: as deployed (bf16 boundary
layers per ``--kv-high-precision-layers`` and the dtype's minimum) and on every layer, which
measures the format itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import torch

from metrale_cli.engine.runner import (RunnerOptions, build_runner, check_kv_support, parse_dtype,
                                       plan_layers, resolve_backend)
from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import KvCacheDtype, parse_kv_cache_dtype
from metrale_cli.layers.context import ForwardContext
from metrale_cli.output import Output

CHUNK = 128  # prefill chunk: later chunks read earlier ones back from the quantized cache


@dataclass(frozen=True)
class QualityOptions:
    model: str | None = None
    corpus: str | None = None
    window: int = 512
    kv_cache_dtypes: tuple[str, ...] = ()  # empty = all 16
    backend: str = "auto"
    dtype: str = "bf16"
    kv_high_precision_layers: str = "0"
    innerq_calibration_tokens: int | None = None


def corpus_text(path: str | None) -> tuple[str, str]:
    """(text, name): the given UTF-8 file, else the corpus shipped in the package."""
    if path is None:
        return resources.files("metrale_cli").joinpath("kv_quality_corpus.txt").read_text("utf-8"), \
            "kv_quality_corpus.txt (shipped)"
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    except (OSError, UnicodeDecodeError) as e:
        raise MetraleError(f"cannot read --corpus {path}: {e}") from None


def windows(ids: list[int], window: int) -> list[list[int]]:
    if window < 2:
        raise MetraleError("--window must be at least 2 tokens")
    cut = [ids[i : i + window] for i in range(0, len(ids), window)]
    cut = [w for w in cut if len(w) >= 2]
    if not cut:
        raise MetraleError("the corpus has fewer than 2 tokens")
    return cut


def teacher_forced_logprobs(runner, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position of ``ids``: (len(ids), vocab) float32 on CPU."""
    engine, cache, dev = runner.engine, runner.model.kv_cache, runner.model.device
    table: list[int] = []
    cache.ensure_capacity(table, len(ids))
    out = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        pos = range(start, start + len(chunk))
        ctx = ForwardContext("prefill", engine._int32(list(pos)), engine._int32(engine._slots(table, pos, 0)),
                             start, engine._int32(table))
        logits = runner.model.forward(torch.tensor(chunk, device=dev), ctx, torch.arange(len(chunk), device=dev))
        out.append(torch.log_softmax(logits.float(), -1).cpu())
    cache.release(table)
    return torch.cat(out)


def compare(ref: list[torch.Tensor], got: list[torch.Tensor], targets: list[list[int]]) -> dict:
    """Mean KL(ref ‖ got), perplexity of ``got`` on the next tokens, top-1 agreement."""
    kl, nll, agree, count = 0.0, 0.0, 0, 0
    for r, g, ids in zip(ref, got, targets):
        r, g = r[:-1], g[:-1]
        nxt = torch.tensor(ids[1:])
        kl += (r.exp() * (r - g)).sum(-1).clamp(min=0).sum().item()
        nll -= g.gather(1, nxt[:, None]).sum().item()
        agree += (r.argmax(-1) == g.argmax(-1)).sum().item()
        count += len(nxt)
    return {"mean_kl": kl / count, "ppl": math.exp(nll / count), "top1_agreement": agree / count}


def _dtypes(names: tuple[str, ...]) -> list[KvCacheDtype]:
    parsed = [parse_kv_cache_dtype(n) for n in names] if names else list(KvCacheDtype)
    if any(not isinstance(d, KvCacheDtype) for d in parsed):
        raise MetraleError("--kv-quality needs concrete --kv-cache-dtype values, not 'auto'")
    return list(dict.fromkeys(parsed))


def run_quality(opts: QualityOptions, out: Output | None = None) -> dict:
    from metrale_cli.checkpoint import load_checkpoint
    from metrale_cli.config import model_config_from_hf

    backend, device = resolve_backend(opts.backend)
    ckpt = load_checkpoint(opts.model, device, parse_dtype(opts.dtype))
    if ckpt.tokenizer is None:
        raise MetraleError("--kv-quality needs a model with a tokenizer")
    text, corpus_name = corpus_text(opts.corpus)
    cuts = windows(ckpt.tokenizer.encode(text, add_special_tokens=False), opts.window)
    cfg = model_config_from_hf(ckpt.config)
    base = RunnerOptions(backend=backend, dtype=opts.dtype, max_seq_len=opts.window, reserve_all_memory=False,
                         prefill_chunk=CHUNK, cuda_graph_mode="disabled",
                         kv_high_precision_layers=opts.kv_high_precision_layers,
                         innerq_calibration_tokens=opts.innerq_calibration_tokens)

    def run(kv: KvCacheDtype, ropts: RunnerOptions):
        loader = check_kv_support(kv, cfg.head_dim, backend, device, plan_layers(cfg, kv, ropts))
        runner = build_runner(ckpt.config, dict(ckpt.tensors), ckpt.tokenizer, ropts, backend, kv,
                              ckpt.source, loader)
        logprobs = [teacher_forced_logprobs(runner, w) for w in cuts]
        return runner, logprobs

    _, ref = run(KvCacheDtype.BF16, base)
    reference = compare(ref, ref, cuts)
    rows = []
    for kv in _dtypes(opts.kv_cache_dtypes):
        if out:
            out.info(f"kv-quality: {kv.value}")
        runner, got = run(kv, base)
        layout = runner.model.kv_cache.layout
        row = {"kv_cache_dtype": kv.value, "bf16_layers": layout.dtypes.count(KvCacheDtype.BF16)
               if kv != KvCacheDtype.BF16 else 0, "kv_bytes_per_token": layout.bytes_per_token(),
               **compare(ref, got, cuts)}
        row["ppl_delta_pct"] = 100 * (row["ppl"] / reference["ppl"] - 1)
        everywhere = RunnerOptions(**{**base.__dict__, "kv_high_precision_layers": "0",
                                      "kv_promote_minimum": False})
        raw = compare(ref, run(kv, everywhere)[1], cuts)
        row["all_layers"] = raw | {"ppl_delta_pct": 100 * (raw["ppl"] / reference["ppl"] - 1)}
        rows.append(row)
    return {"model": ckpt.source, "backend": backend, "corpus": corpus_name,
            "tokens": sum(len(w) for w in cuts), "windows": len(cuts), "window": opts.window,
            "num_layers": cfg.num_layers, "reference_ppl": reference["ppl"], "rows": rows}


def run_quality_cmd(out: Output, opts: QualityOptions) -> dict:
    result = run_quality(opts, out)
    if out.json_mode:
        out.json(result)
        return result
    rows = [[r["kv_cache_dtype"], str(r["bf16_layers"]), str(r["kv_bytes_per_token"]), f"{r['mean_kl']:.4f}",
             f"{r['ppl_delta_pct']:+.2f}%", f"{100 * r['top1_agreement']:.1f}%",
             f"{r['all_layers']['mean_kl']:.4f}", f"{r['all_layers']['ppl_delta_pct']:+.2f}%",
             f"{100 * r['all_layers']['top1_agreement']:.1f}%"] for r in result["rows"]]
    out.table(f"KV quality vs bf16 KV: {result['model']}",
              ["kv dtype", "bf16 layers", "KV B/token", "mean KL", "ΔPPL", "top-1",
               "KL (all layers)", "ΔPPL (all)", "top-1 (all)"], rows,
              caption=f"{result['corpus']}: {result['tokens']} tokens in {result['windows']} windows of "
                      f"≤{result['window']}; bf16 KV perplexity {result['reference_ppl']:.3f}; "
                      f"backend {result['backend']}")
    return result
