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

import dataclasses
import math
from dataclasses import dataclass
from importlib import resources

import torch

from metrale_cli.engine.runner import DTYPES, RunnerOptions, open_runner, resolve_backend, resolve_dtype
from metrale_cli.engine.source import ModelSource
from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import KvCacheDtype, concrete
from metrale_cli.models import model_config
from metrale_cli.output import Output

CHUNK = 128  # prefill chunk: later chunks read earlier ones back from the quantized cache


@dataclass(frozen=True)
class QualityOptions:
    model: str | None = None
    corpus: str | None = None
    window: int = 512
    kv_cache_dtypes: tuple[KvCacheDtype | str, ...] = ()  # empty = all 16
    backend: str = "auto"
    dtype: str = "bf16"
    kv_high_precision_layers: str = "0"
    innerq_calibration_tokens: int | None = None

    def __post_init__(self):
        if self.window < 2:
            raise MetraleError(f"--window must be at least 2 tokens, got {self.window}", hint="e.g. --window 512")


def corpus_text(path: str | None) -> tuple[str, str]:
    """(text, name): the given UTF-8 file, else the corpus shipped in the package."""
    if path is None:
        return resources.files("metrale_cli.commands").joinpath("kv_quality_corpus.txt").read_text("utf-8"), \
            "kv_quality_corpus.txt (shipped)"
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    except (OSError, UnicodeDecodeError) as e:
        raise MetraleError(f"cannot read --corpus {path}: {e}", hint="give a UTF-8 text file") from None


def windows(ids: list[int], window: int) -> list[list[int]]:
    cut = [ids[i : i + window] for i in range(0, len(ids), window)]
    cut = [w for w in cut if len(w) >= 2]
    if not cut:
        raise MetraleError("the corpus has fewer than 2 tokens", hint="give a longer --corpus text file")
    return cut


def teacher_forced_logprobs(runner, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position of ``ids``: (len(ids), vocab) float32 on CPU;
    logits that are not finite are an error (a KL or perplexity of NaN would be printed)."""
    logits = runner.engine.teacher_forced(ids).float()
    if not bool(torch.isfinite(logits).all()):
        raise MetraleError(f"the model's logits are not finite (NaN or inf) with a {runner.kv_dtype.value} KV cache",
                           hint="activations overflowed or the weights are corrupt; with --dtype fp16, try bf16")
    return torch.log_softmax(logits, -1).cpu()


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


def _dtypes(names: tuple[KvCacheDtype | str, ...]) -> list[KvCacheDtype]:
    return list(dict.fromkeys([concrete(n) for n in names] if names else list(KvCacheDtype)))


def run_quality(opts: QualityOptions, out: Output | None = None) -> dict:
    dtypes = _dtypes(opts.kv_cache_dtypes)
    backend, device = resolve_backend(opts.backend)
    text, corpus_name = corpus_text(opts.corpus)  # before the weights: fail fast
    checkpoint = ModelSource.checkpoint(opts.model)
    context = model_config(checkpoint.config).max_position_embeddings
    if opts.window > context:
        raise MetraleError(f"--window {opts.window} is past the model's context of {context} tokens",
                           hint=f"use --window {context} or less")
    dtype, _ = resolve_dtype(opts.dtype, checkpoint.config)
    weights = checkpoint.load(device, DTYPES[dtype], None)
    if weights.tokenizer is None:
        raise MetraleError("--kv-quality needs a model with a tokenizer", hint="pass a checkpoint with tokenizer.json or a .gguf")
    source = ModelSource.loaded(checkpoint.config, weights.tensors, weights.tokenizer, weights.name)
    cuts = windows(weights.tokenizer.encode(text, add_special_tokens=False), opts.window)
    base = RunnerOptions(backend=backend, dtype=dtype, max_seq_len=opts.window, reserve_all_memory=False,
                         prefill_chunk=CHUNK, cuda_graph_mode="disabled",
                         kv_high_precision_layers=opts.kv_high_precision_layers,
                         innerq_calibration_tokens=opts.innerq_calibration_tokens)

    def run(kv: KvCacheDtype, ropts: RunnerOptions):
        runner = open_runner(dataclasses.replace(ropts, kv_cache_dtype=kv), source)
        return runner, [teacher_forced_logprobs(runner, w) for w in cuts]

    _, ref = run(KvCacheDtype.BF16, base)
    reference = compare(ref, ref, cuts)
    rows = []
    for kv in dtypes:
        if out:
            out.info(f"kv-quality: {kv.value}")
        runner, got = run(kv, base)
        layout = runner.model.kv_cache.layout
        row = {"kv_cache_dtype": kv.value, "bf16_layers": layout.dtypes.count(KvCacheDtype.BF16)
               if kv != KvCacheDtype.BF16 else 0, "kv_bytes_per_token": layout.bytes_per_token(),
               **compare(ref, got, cuts)}
        row["ppl_delta_pct"] = 100 * (row["ppl"] / reference["ppl"] - 1)
        everywhere = dataclasses.replace(base, kv_high_precision_layers="0", kv_promote_minimum=False)
        raw = compare(ref, run(kv, everywhere)[1], cuts)
        row["all_layers"] = raw | {"ppl_delta_pct": 100 * (raw["ppl"] / reference["ppl"] - 1)}
        rows.append(row)
    return {"model": weights.name, "backend": backend, "corpus": corpus_name,
            "tokens": sum(len(w) for w in cuts), "windows": len(cuts), "window": opts.window,
            "num_layers": runner.config.num_layers, "reference_ppl": reference["ppl"], "rows": rows}


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
