"""From options to a ready Runner: backend choice, start-up kernel check, weights, KV pool.

The order is the contract: resolve the backend and the KV dtype, check the dtype's kernels
(before any weight is read), load and check the weights, size the pool, build the layer stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from metrale_cli.config import ModelConfig, model_config_from_hf
from metrale_cli.engine.cuda_graphs import DecodeGraphs
from metrale_cli.engine.generate import Engine
from metrale_cli.environment import decode_stack, prefill_host_timing
from metrale_cli.layers.host_timing import HostTiming
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import Ops
from metrale_cli.kv.dtypes import AUTO, KvCacheDtype, kv_pair, parse_kv_cache_dtype, resolve_auto
from metrale_cli.kv.formats import SIDE_FORMATS, side_format
from metrale_cli.kv.innerq import InnerQSettings
from metrale_cli.kv.paged import KvLayout, blocks_for
from metrale_cli.kv.precision import describe as describe_layers
from metrale_cli.kv.precision import layer_dtypes
from metrale_cli.models import build_model
from metrale_cli.models.model import CausalLM
from metrale_cli.tokenizer import Tokenizer

BACKENDS = ("auto", "cuda", "torch")
GRAPH_MODES = ("disabled", "full")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class RunnerOptions:
    model: str | None = None
    backend: str = "auto"
    kv_cache_dtype: str = "auto"
    dtype: str = "bf16"
    max_seq_len: int | None = None
    max_num_seqs: int = 1
    gpu_memory_utilization: float = 0.9
    reserve_all_memory: bool = True  # GPU: pool = what the utilization allows; else what the run needs
    fp8_kv_calibration_tokens: int = 256
    prefill_chunk: int = 512
    cuda_graph_mode: str = "full"  # full: replay the decode step as a CUDA graph (cuda backend)
    kv_high_precision_layers: str = "0"  # N | auto | max | all (plus the dtype's minimum)
    kv_promote_minimum: bool = True  # False only to measure a dtype on every layer (kv-quality)
    innerq_calibration_tokens: int | None = None  # None: TURBO_INNERQ, else off
    innerq_strength: float | None = None  # None: TURBO_INNERQ_STRENGTH, else 0.5

    def innerq(self) -> InnerQSettings:
        from metrale_cli.environment import innerq_env

        tokens, strength = innerq_env()
        return InnerQSettings(
            tokens=self.innerq_calibration_tokens if self.innerq_calibration_tokens is not None else tokens,
            strength=self.innerq_strength if self.innerq_strength is not None else strength)


@dataclass
class Runner:
    model: CausalLM
    engine: Engine
    tokenizer: object | None
    backend: str
    kv_dtype: KvCacheDtype
    source: str
    messages: list[str] = field(default_factory=list)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg


def resolve_backend(name: str) -> tuple[str, torch.device]:
    if name not in BACKENDS:
        raise MetraleError(f"unknown --backend '{name}'", hint="choose one of: " + ", ".join(BACKENDS))
    has_gpu = torch.cuda.is_available()
    if name == "cuda" and not has_gpu:
        raise MetraleError("--backend cuda needs an NVIDIA GPU, and torch sees none",
                           hint="use --backend torch to run the reference path on the CPU")
    if name == "auto":
        name = "cuda" if has_gpu else "torch"
    return name, torch.device("cuda" if has_gpu else "cpu")


def make_ops(backend: str, loader=None) -> Ops:
    if backend == "cuda":
        from metrale_cli.kernels.cuda_ops import CudaOps

        return CudaOps(loader)
    from metrale_cli.kernels.reference import TorchOps

    return TorchOps()


def check_kv_support(kv_dtype: KvCacheDtype, head_dim: int, backend: str, device: torch.device,
                     dtypes: tuple[KvCacheDtype, ...] = ()):
    """The start-up check, before any weight is read. Returns the kernel loader (cuda) or None.

    torch: a dtype is usable once every side has a codec (``kv/formats.py``) and, for a rotated
    side, head_dim is a WHT size. cuda: every kernel the KV dtype needs (KV_DTYPES.md's table)
    and every kernel the layers launch, for each layer dtype in ``dtypes`` too (high-precision
    layers), is compiled and loaded through CuPy; all problems are reported in one message.
    """
    from metrale_cli.kernels.requirements import validate_required_kv_kernels
    from metrale_cli.kv.wht import wht_signs

    every = list(dict.fromkeys((kv_dtype, *dtypes)))
    sides = {s for d in every for s in kv_pair(d)}
    missing = [s.value for s in sides if s not in SIDE_FORMATS]
    if missing:
        raise MetraleError(f"kv-cache-dtype {kv_dtype.value} has no cache codec in this build "
                           f"(side types: {', '.join(missing)})")
    if any(side_format(s).rotated for s in sides):
        wht_signs(head_dim)  # refuses a head_dim the rotation does not serve
    if backend != "cuda":
        return None
    from metrale_cli.kernels.table import layer_kernels
    from metrale_cli.kernels.loader import KernelLoader

    loader = KernelLoader()

    def load(spec) -> str | None:
        try:
            loader.function(spec, device)
        except MetraleError as e:
            return e.message
        except Exception as e:  # a CuPy compile or load failure: report it, do not hide it
            return f"does not load: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
        return None

    for d in every:
        validate_required_kv_kernels(d, head_dim, load)
    stack = decode_stack()
    specs = dict.fromkeys(spec for d in every for spec in layer_kernels(d, head_dim, stack))
    problems = {str(spec): why for spec in specs if (why := load(spec))}
    if problems:
        raise MetraleError(
            f"the cuda backend needs kernel(s) that do not load: {', '.join(problems)}",
            hint="; ".join(sorted(set(problems.values()))),
        )
    return loader


def pool_blocks(layout: KvLayout, opts: RunnerOptions, max_seq_len: int, device: torch.device) -> int:
    """GPU: what --gpu-memory-utilization leaves after the weights. CPU: what the run needs."""
    needed = blocks_for(max_seq_len) * max(1, opts.max_num_seqs)
    if device.type != "cuda" or not opts.reserve_all_memory:
        return needed
    free, total = torch.cuda.mem_get_info(device)
    budget = opts.gpu_memory_utilization * total - (total - free)
    blocks = int(budget // layout.bytes_per_block())
    if blocks < blocks_for(max_seq_len):
        raise MetraleError(
            f"KV cache pool too small: {max(blocks, 0)} blocks fit, one {max_seq_len}-token "
            f"sequence needs {blocks_for(max_seq_len)}",
            hint="raise --gpu-memory-utilization or lower --max-seq-len",
        )
    return blocks


def kv_messages(layout: KvLayout, blocks: int, max_seq_len: int) -> list[str]:
    """The KV lines a run prints once: bytes per token and pool capacity, per-layer dtypes."""
    dtypes = layout.dtypes
    main = next((d for d in dtypes if d != KvCacheDtype.BF16), KvCacheDtype.BF16)  # the requested one
    lines = [f"KV cache: {main.value}, {layout.bytes_per_token()} bytes/token over {layout.num_layers} "
             f"layers, {blocks} blocks = {blocks * 16} tokens, context {max_seq_len}"]
    if len(set(dtypes)) > 1:
        per = ", ".join(f"{d.value} {layout.layer_bytes_per_token(dtypes.index(d))} B"
                        for d in dict.fromkeys(dtypes))
        lines.append(f"KV layer dtypes: {describe_layers(dtypes)} (per layer and token: {per})")
    return lines


def plan_layers(cfg: ModelConfig, kv_dtype: KvCacheDtype, opts: RunnerOptions) -> tuple[KvCacheDtype, ...]:
    return layer_dtypes(kv_dtype, cfg.num_layers, opts.kv_high_precision_layers, opts.kv_promote_minimum)


def build_runner(raw_config: dict, tensors: dict[str, torch.Tensor], tokenizer, opts: RunnerOptions,
                 backend: str, kv_dtype: KvCacheDtype, source: str, loader=None) -> Runner:
    """Build from weights already on the device (the checkpoint path and bench presets share it)."""
    cfg = model_config_from_hf(raw_config)
    device = next(iter(tensors.values())).device
    max_seq_len = context_length(cfg, opts)
    dtypes = plan_layers(cfg, kv_dtype, opts)
    layout = KvLayout(cfg.num_kv_heads, cfg.head_dim, dtypes)
    blocks = pool_blocks(layout, opts, max_seq_len, device)
    model = build_model(cfg, tensors, make_ops(backend, loader), kv_dtype, blocks, max_seq_len,
                        opts.fp8_kv_calibration_tokens, device, innerq=opts.innerq(), dtypes=dtypes)
    check_graph_mode(opts.cuda_graph_mode)
    stack = None
    if decode_stack():
        stack = ("batch-1 decode: one persistent kernel for all layers (METRALE_DECODE_STACK)"
                 if model.plan_decode_stack() else
                 "METRALE_DECODE_STACK: the whole-stack kernel does not serve this model or GPU "
                 "(--debug logs why); its layers run one by one")
    capture, decode_mode = False, "decode: eager (--cuda-graph-mode disabled)"
    if device.type != "cuda":
        decode_mode = "decode: eager (no GPU)"
    elif opts.cuda_graph_mode == "full":
        why = model.decode_graph_unsupported()
        capture = why is None
        decode_mode = (f"decode: eager, not CUDA graphs ({why})" if why
                       else "decode: CUDA graphs (one per batch-size bucket)")
    graphs = DecodeGraphs(model, max(1, opts.max_num_seqs), blocks_for(max_seq_len), capture)
    timing = HostTiming() if prefill_host_timing() else None
    runner = Runner(model, Engine(model, max_seq_len, opts.prefill_chunk, graphs, timing), tokenizer, backend,
                    kv_dtype, source)
    runner.messages += kv_messages(layout, blocks, max_seq_len)
    for policy in (model.fp8_scales, model.innerq):
        if policy.describe():
            runner.messages.append(policy.describe())
    cold = [e for e in getattr(loader, "events", []) if e.cold]
    if cold:
        runner.messages.append(f"compiled {len(cold)} kernel module(s) in "
                               f"{sum(e.seconds for e in cold):.1f} s (cached for the next start)")
    runner.messages.append(decode_mode)
    if stack:
        runner.messages.append(stack)
    return runner


def context_length(cfg: ModelConfig, opts: RunnerOptions) -> int:
    """--max-seq-len, else the model's context capped at 8192 tokens."""
    return opts.max_seq_len or min(cfg.max_position_embeddings, 8192)


def check_graph_mode(mode: str) -> None:
    if mode not in GRAPH_MODES:
        raise MetraleError(f"unknown --cuda-graph-mode '{mode}'", hint="choose one of: " + ", ".join(GRAPH_MODES))


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise MetraleError(f"unknown --dtype '{name}'", hint="choose one of: " + ", ".join(DTYPES))
    return DTYPES[name]


def load_runner(opts: RunnerOptions, progress: Callable[[int, int], None] | None = None,
                before_weights: Callable[[Tokenizer, int], None] | None = None) -> Runner:
    """Resolve, check kernels, load the checkpoint and build. Errors are MetraleError.

    ``before_weights(tokenizer, context_length)`` runs after the kernel check and before any
    weight is read (e.g. to refuse a prompt that cannot fit)."""
    from metrale_cli.checkpoint import load_checkpoint, read_config, read_tokenizer

    backend, device = resolve_backend(opts.backend)
    dtype = parse_dtype(opts.dtype)
    check_graph_mode(opts.cuda_graph_mode)
    requested = parse_kv_cache_dtype(opts.kv_cache_dtype)
    raw = read_config(opts.model)
    cfg = model_config_from_hf(raw)
    kv_dtype = resolve_auto(raw.get("kv_cache_dtype")) if requested == AUTO else requested
    loader = check_kv_support(kv_dtype, cfg.head_dim, backend, device, plan_layers(cfg, kv_dtype, opts))
    if before_weights is not None:
        before_weights(read_tokenizer(opts.model), context_length(cfg, opts))
    ckpt = load_checkpoint(opts.model, device, dtype, progress)
    return build_runner(ckpt.config, dict(ckpt.tensors), ckpt.tokenizer, opts, backend, kv_dtype,
                        ckpt.source, loader)
