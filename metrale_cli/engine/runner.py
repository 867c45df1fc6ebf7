"""From options to a ready Runner: the one entry point of ``generate``, ``bench`` and
``bench --kv-quality`` (:func:`open_runner`).

The order is the contract: resolve the backend, read the config through its family (once),
resolve the KV dtype (``auto`` in ``ModelConfig``), plan every layer (its KV dtype, with the
high-precision boundary layers; once), refuse a layer field nothing serves, check every kernel
the plan launches (before any weight is read), then load the weights, size the pool and build.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from metrale_cli.config import ModelConfig
from metrale_cli.engine.cuda_graphs import DecodeGraphs
from metrale_cli.engine.generate import Engine
from metrale_cli.engine.room import check_pool_room, check_room, weight_bytes
from metrale_cli.engine.source import ModelSource
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.ops import Ops
from metrale_cli.kv.dtypes import AUTO, KvCacheDtype
from metrale_cli.kv.fp8 import FP8_CALIBRATION_TOKENS
from metrale_cli.kv.innerq import InnerQSettings
from metrale_cli.kv.paged import KvLayout, blocks_for
from metrale_cli.kv.precision import describe as describe_layers
from metrale_cli.kv.precision import layer_dtypes
from metrale_cli.layers.spec import check_served
from metrale_cli.models import build_model, kv_layout, model_config
from metrale_cli.models.model import CausalLM
from metrale_cli.layers.parallel import SINGLE, TensorParallel
from metrale_cli.models.sharding import Sharder, shard_config

BACKENDS = ("auto", "cuda", "torch")
GRAPH_MODES = ("disabled", "full")
ALL_REDUCES = ("nccl", "one-shot")  # --all-reduce: how tensor-parallel ranks sum a decode step's parts
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# --dtype as vLLM and torch spell it, besides metrale's own names; "auto" is resolved by resolve_dtype.
DTYPE_SPELLINGS = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
AUTO_DTYPE = "auto"


def resolve_dtype(name: str, config: dict | None) -> tuple[str, str | None]:
    """A --dtype value -> (bf16 | fp16 | fp32, the line that says what ``auto`` chose, or None).
    ``auto``: the checkpoint's own bf16 or fp16 (config ``torch_dtype`` / ``dtype``), else bf16."""
    key = DTYPE_SPELLINGS.get(name.strip().lower(), name.strip().lower())
    if key in DTYPES:
        return key, None
    if key != AUTO_DTYPE:
        raise MetraleError(f"unknown --dtype '{name}'",
                           hint="choose one of: " + ", ".join([*DTYPES, *DTYPE_SPELLINGS, AUTO_DTYPE]))
    declared = str((config or {}).get("torch_dtype") or (config or {}).get("dtype") or "").removeprefix("torch.")
    chosen = {"bfloat16": "bf16", "float16": "fp16"}.get(declared, "bf16")
    why = f"the checkpoint's {declared}" if declared in ("bfloat16", "float16") else \
        (f"the checkpoint declares {declared}; bf16 is used" if declared else "the checkpoint declares none")
    return chosen, f"dtype auto: {chosen} ({why})"


@dataclass(frozen=True)
class RunnerOptions:
    """How to run a model. ``kv_cache_dtype``: a :class:`KvCacheDtype`, its name or alias, or
    ``auto`` (the checkpoint's declared KV dtype, else bf16)."""

    backend: str = "auto"
    kv_cache_dtype: KvCacheDtype | str = AUTO
    dtype: str = "bf16"
    max_seq_len: int | None = None
    max_num_seqs: int = 1
    gpu_memory_utilization: float = 0.9
    reserve_all_memory: bool = True  # GPU: pool = what the utilization allows; else what the run needs
    fp8_kv_calibration_tokens: int | None = None  # None: FP8_CALIBRATION_TOKENS where a side is fp8
    prefill_chunk: int = 512
    cuda_graph_mode: str = "full"  # full: replay the decode step as a CUDA graph (cuda backend)
    kv_high_precision_layers: str = "0"  # N | auto | max | all (plus the dtype's minimum)
    kv_promote_minimum: bool = True  # False only to measure a dtype on every layer (kv-quality)
    innerq_calibration_tokens: int | None = None  # None: TURBO_INNERQ, else off
    innerq_strength: float | None = None  # None: TURBO_INNERQ_STRENGTH, else 0.5
    all_reduce: str = "nccl"  # one-shot: the ranks' small sums and gathers by kernels_cu/all_reduce.cu

    def innerq(self) -> InnerQSettings:
        from metrale_cli.environment import innerq_env

        tokens, strength = innerq_env()
        return InnerQSettings(
            tokens=self.innerq_calibration_tokens if self.innerq_calibration_tokens is not None else tokens,
            strength=self.innerq_strength if self.innerq_strength is not None else strength)

    def check(self) -> None:
        """Every option in range, before anything is read."""
        choose = {"--backend": (self.backend, BACKENDS), "--dtype": (self.dtype, tuple(DTYPES)),
                  "--cuda-graph-mode": (self.cuda_graph_mode, GRAPH_MODES),
                  "--all-reduce": (self.all_reduce, ALL_REDUCES)}
        for flag, (value, allowed) in choose.items():
            if value not in allowed:
                raise MetraleError(f"unknown {flag} '{value}'", hint="choose one of: " + ", ".join(allowed))
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise MetraleError(f"--max-seq-len must be at least 2, got {self.max_seq_len}",
                               hint="leave it out for the model's context (at most 8192)")
        if self.max_num_seqs < 1:
            raise MetraleError(f"the number of sequences must be at least 1, got {self.max_num_seqs}",
                               hint="give at least one prompt")
        check_memory_fraction(self.gpu_memory_utilization)
        if self.prefill_chunk < 1:
            raise MetraleError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}",
                               hint="tokens per prefill chunk, e.g. 512")
        if self.fp8_kv_calibration_tokens is not None and self.fp8_kv_calibration_tokens < 0:
            raise MetraleError("--fp8-kv-calibration-tokens must not be negative", hint="0 turns the calibration off")
        if self.innerq_calibration_tokens is not None and self.innerq_calibration_tokens < 0:
            raise MetraleError(f"--innerq-calibration-tokens must not be negative, got {self.innerq_calibration_tokens}",
                               hint="0 turns InnerQ off")


@dataclass
class Runner:
    """A built model, its engine and tokenizer: what every command runs."""

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


def plan(cfg: ModelConfig, kv_dtype: KvCacheDtype, opts: RunnerOptions) -> ModelConfig:
    """The config with every layer's KV dtype: ``kv_dtype``, the boundary layers of
    ``--kv-high-precision-layers`` (and the dtype's minimum) in bf16. Boundary layers count the
    layers that hold KV only (a hybrid's GDN layers hold none and stay at the bf16 default)."""
    kv_layers = [s.index for s in cfg.layers if s.has_kv]
    dtypes = dict(zip(kv_layers, layer_dtypes(kv_dtype, len(kv_layers), opts.kv_high_precision_layers,
                                              opts.kv_promote_minimum)))
    return cfg.planned(tuple(dtypes.get(i, KvCacheDtype.BF16) for i in range(cfg.num_layers)))


def check_kernels(cfg: ModelConfig, backend: str, device: torch.device, requested: KvCacheDtype | None = None):
    """The start-up check of a planned config, before any weight is read: every (KV dtype,
    head_dim) its layers use, and the ``requested`` dtype at each of its head_dims, is served; on
    the cuda backend every kernel they launch compiles and loads through CuPy, all problems
    reported in one message. Returns the kernel loader (cuda)."""
    from metrale_cli.kernels.kv_kernels import layer_kernels
    from metrale_cli.kernels.table import GDN_KERNELS, MOE_KERNELS, for_arch
    from metrale_cli.kernels.requirements import validate_required_kv_kernels

    kv_layers = [s for s in cfg.layers if s.has_kv]
    asked = [(requested, s.attention.head_dim) for s in kv_layers] if requested is not None else []
    used = dict.fromkeys(asked + [(s.kv_dtype, s.attention.head_dim) for s in kv_layers])
    if backend != "cuda":
        from metrale_cli.kernels.reference import TorchOps

        for d, head_dim in used:
            TorchOps.paged_attention(d, head_dim)  # a rotated side refuses a head_dim the WHT does not serve
        return None
    from metrale_cli.kernels.registry import ARCH
    from metrale_cli.kernels.loader import KernelLoader, device_arch, device_index

    loader = KernelLoader()
    arch = device_arch(device_index(device)) if device.type == "cuda" else ARCH  # the GPU's, else the build's

    def load(spec) -> str | None:
        try:
            loader.function(spec, device)
        except MetraleError as e:
            return e.message
        except Exception as e:  # a CuPy compile or load failure: report it, do not hide it
            return f"does not load: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
        return None

    for d, head_dim in used:
        validate_required_kv_kernels(d, head_dim, load)
    specs = dict.fromkeys(spec for d, head_dim in used for spec in layer_kernels(d, head_dim))
    if any(s.ffn.kind == "moe" for s in cfg.layers):
        specs.update(dict.fromkeys(MOE_KERNELS))
    gdn = [s.gdn for s in cfg.layers if s.mixer == "gdn"]
    if gdn:
        specs.update(dict.fromkeys(GDN_KERNELS))
        _check_gdn_shared(gdn, arch)
    problems = {str(spec): why for spec in for_arch(specs, arch) if (why := load(spec))}
    if problems:
        raise MetraleError(f"the cuda backend needs kernel(s) that do not load: {', '.join(problems)}",
                           hint="; ".join(sorted(set(problems.values()))))
    return loader


def _check_gdn_shared(specs, arch: str) -> None:
    """The chunked Gated DeltaNet prefill kernel (gdn_chunk_prep_f32) stages a chunk in shared
    memory: refuse at start-up a GPU whose blocks may not have that much (sm_89 at head dims 128,
    sm_80 at 256), rather than fail at the first prompt."""
    from metrale_cli.kernels.table import BLOCK_SHARED_OPTIN, gdn_prep_shared_bytes

    have = BLOCK_SHARED_OPTIN.get(arch)
    g = max(specs, key=lambda g: gdn_prep_shared_bytes(g.head_k_dim, g.head_v_dim))
    need = gdn_prep_shared_bytes(g.head_k_dim, g.head_v_dim)
    if have is not None and need > have:
        raise MetraleError(f"the Gated DeltaNet prefill kernel needs {need:,} bytes of shared memory a block "
                           f"(head dims {g.head_k_dim} x {g.head_v_dim}); an {arch} GPU allows {have:,}",
                           hint="use --backend torch for this model on this GPU")


def context_length(cfg: ModelConfig, opts: RunnerOptions) -> int:
    """--max-seq-len, else the model's context capped at 8192 tokens; never past the model's."""
    if opts.max_seq_len is not None and opts.max_seq_len > cfg.max_position_embeddings:
        raise MetraleError(f"--max-seq-len {opts.max_seq_len} is past the model's context of "
                           f"{cfg.max_position_embeddings} tokens (max_position_embeddings)",
                           hint=f"use --max-seq-len {cfg.max_position_embeddings} or less")
    return opts.max_seq_len or min(cfg.max_position_embeddings, 8192)


def check_memory_fraction(fraction: float) -> None:
    """--gpu-memory-utilization in (0, 1], or one error line."""
    if not 0 < fraction <= 1:
        raise MetraleError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}",
                           hint="a fraction of the GPU's memory, e.g. 0.9")


def fraction_blocks(layout: KvLayout, fraction: float, device: torch.device, freed: int = 0) -> int:
    """The blocks of a GPU pool in ``fraction`` of its memory less what is in use (``freed`` bytes
    of that counted as free: a pool the new one would replace); 0 when none fit."""
    free, total = torch.cuda.mem_get_info(device)
    return max(int((fraction * total - (total - free) + freed) // layout.bytes_per_block()), 0)


def pool_blocks(layout: KvLayout, opts: RunnerOptions, max_seq_len: int, device: torch.device) -> int:
    """GPU: what --gpu-memory-utilization leaves after the weights. CPU: what the run needs."""
    needed = blocks_for(max_seq_len) * max(1, opts.max_num_seqs)
    if device.type != "cuda" or not opts.reserve_all_memory:
        return needed
    blocks = fraction_blocks(layout, opts.gpu_memory_utilization, device)
    if blocks < blocks_for(max_seq_len):
        raise MetraleError(
            f"KV cache pool too small: {blocks} blocks fit, one {max_seq_len}-token "
            f"sequence needs {blocks_for(max_seq_len)}",
            hint="raise --gpu-memory-utilization or lower --max-seq-len",
        )
    return blocks


def kv_messages(layout: KvLayout, blocks: int, max_seq_len: int, requested: KvCacheDtype) -> list[str]:
    """The KV lines a run prints once: bytes per token and pool capacity, and each layer's dtype
    wherever one differs from the requested dtype (boundary layers kept in bf16)."""
    dtypes = layout.dtypes
    kv_layers = len(layout.kv_layers)
    over = f"{kv_layers} layers" if kv_layers == layout.num_layers else \
        f"the {kv_layers} attention layers of {layout.num_layers}"
    lines = [f"KV cache: {requested.value}, {layout.bytes_per_token()} bytes/token over {over}, "
             f"{blocks} blocks = {blocks * 16} tokens, context {max_seq_len}"]
    if set(dtypes) - {None} != {requested}:
        per = ", ".join(f"{d.value} {layout.layer_bytes_per_token(dtypes.index(d))} B"
                        for d in dict.fromkeys(dtypes) if d is not None)
        none = "" if requested in dtypes else f"; no layer is {requested.value}: every one kept in higher precision"
        lines.append(f"KV layer dtypes: {describe_layers(dtypes)} (per layer and token: {per}){none}")
    return lines


def state_messages(model: CausalLM) -> list[str]:
    """The recurrent-state line of a hybrid: bytes per sequence over its recurrent layers and
    how many sequences the pools hold; none for a model that keeps only KV."""
    layers = [layer for layer in model.layers if layer.state_bytes()]
    if not layers:
        return []
    per = model.state_bytes_per_sequence()
    return [f"recurrent state: {per} bytes/sequence ({per / 2**20:.2f} MiB, fp32) over {len(layers)} "
            f"Gated DeltaNet layers, {model.free_state_slots()} sequences at once (max_num_seqs)"]


def _decode_mode(model: CausalLM, opts: RunnerOptions) -> tuple[bool, str]:
    """(capture CUDA graphs, the line that says how decode runs)."""
    if model.device.type != "cuda":
        return False, "decode: eager (no GPU)"
    if opts.cuda_graph_mode != "full":
        return False, "decode: eager (--cuda-graph-mode disabled)"
    why = model.decode_graph_unsupported()
    if why:
        return False, f"decode: eager, not CUDA graphs ({why})"
    return True, "decode: CUDA graphs (one per batch-size bucket)"


def check_all_reduce(opts: RunnerOptions, tp: TensorParallel, backend: str) -> None:
    """``--all-reduce one-shot`` where it can run: tensor-parallel ranks on the cuda backend."""
    if opts.all_reduce != "one-shot":
        return
    if tp.size < 2:
        raise MetraleError("--all-reduce one-shot sums the parts of tensor-parallel ranks, and this run has one",
                           hint="add --tensor-parallel-size 2 (or more), or drop --all-reduce")
    if backend != "cuda":
        raise MetraleError("--all-reduce one-shot runs on the cuda backend",
                           hint="drop --all-reduce, or use --backend cuda")


def one_shot_ranks(tp: TensorParallel, opts: RunnerOptions, backend: str, device: torch.device, cfg: ModelConfig,
                   loader) -> TensorParallel:
    """``tp`` with the one-shot collectives where ``--all-reduce one-shot`` asks for them (every
    rank allocates and maps its buffers together), sized for a decode step of ``max_num_seqs``
    rows: its hidden rows in bf16 and its logits in fp32, whichever is larger."""
    if opts.all_reduce != "one-shot":
        return tp
    from metrale_cli.kernels.cuda_collectives import one_shot_for_group
    from metrale_cli.kernels.cuda_launch import CudaLauncher

    rows = max(1, opts.max_num_seqs)
    capacity = -(-max(rows * cfg.hidden_size * 2, rows * tp.vocab_rows(cfg.vocab_size) * 4) // 16) * 16
    one_shot = one_shot_for_group(tp.rank, tp.size, tp.group, device, capacity, CudaLauncher(loader))
    return dataclasses.replace(tp, one_shot=one_shot)


def open_runner(opts: RunnerOptions, source: ModelSource, progress: Callable[[int, int], None] | None = None,
                before_weights: Callable[[object, int, int], None] | None = None, tp: TensorParallel = SINGLE) -> Runner:
    """Check everything, then load and build (the module docstring's order). Errors are MetraleError.

    ``before_weights(tokenizer, context_length, vocab_size)`` runs after the kernel check and
    before any weight is read (e.g. to refuse a prompt that cannot fit). ``tp``: the tensor-parallel rank
    this process builds the shard of (metrale_cli/layers/parallel.py): its heads' kernels are
    checked, and each tensor is cut to the rank's part on the CPU as it is read, only that part
    moved to the device."""
    dtype, dtype_line = resolve_dtype(opts.dtype, source.config)
    opts = dataclasses.replace(opts, dtype=dtype)
    opts.check()
    backend, device = resolve_backend(opts.backend)
    check_all_reduce(opts, tp, backend)
    cfg = model_config(source.config)
    kv_dtype = cfg.resolve_kv_dtype(opts.kv_cache_dtype)
    cfg = plan(cfg, kv_dtype, opts)
    max_seq_len = context_length(cfg, opts)
    check_served(cfg.layers, max_seq_len)
    shard = shard_config(cfg, tp)
    loader = check_kernels(shard, backend, device, kv_dtype)
    tokenizer = source.tokenizer()
    if tokenizer is not None:  # where the model's vocabulary and the files' token ids are both known
        cfg.check_token_ids(tokenizer.declared_ids)
    if before_weights is not None:
        before_weights(tokenizer, max_seq_len, cfg.vocab_size)
    layout = kv_layout(shard)
    # On the host the pool is what the run needs, known before a weight is read (and counted in the
    # room check); a GPU's is what the weights leave.
    host_blocks = pool_blocks(layout, opts, max_seq_len, device) if device.type != "cuda" else None
    pool = layout.bytes_per_block() * host_blocks if host_blocks is not None else 0
    if not source.resident:
        check_room("the model", weight_bytes(shard, DTYPES[opts.dtype]), device, tp, pool=pool)
    else:  # the weights are in memory already: the pool must fit beside them
        check_pool_room(pool, device)
    if tp.size == 1 or source.sharded:
        weights = source.load(device, DTYPES[opts.dtype], progress)
    else:  # each tensor sharded as it is read: a rank holds its shard and one tensor more
        weights = source.load(device, DTYPES[opts.dtype], progress, transform=Sharder(cfg, tp))
    # The build takes the only reference to a checkpoint's tensors: each one it fuses into a new
    # tensor (q/k/v, gate/up) is freed once copied, not held beside the copy to the end.
    tensors, tokenizer, name = dict(weights.tensors), weights.tokenizer, weights.name
    weights = None
    blocks = host_blocks if host_blocks is not None else pool_blocks(layout, opts, max_seq_len, device)
    tp = one_shot_ranks(tp, opts, backend, device, shard, loader)
    model = build_model(shard, tensors, make_ops(backend, loader), blocks, max_seq_len,
                        FP8_CALIBRATION_TOKENS if opts.fp8_kv_calibration_tokens is None
                        else opts.fp8_kv_calibration_tokens, device, innerq=opts.innerq(),
                        max_seqs=max(1, opts.max_num_seqs), tp=tp)
    capture, decode_mode = _decode_mode(model, opts)
    graphs = DecodeGraphs(model, max(1, opts.max_num_seqs), blocks_for(max_seq_len), capture)
    runner = Runner(model, Engine(model, max_seq_len, opts.prefill_chunk, graphs), tokenizer, backend, kv_dtype,
                    name)
    runner.messages += kv_messages(layout, blocks, max_seq_len, kv_dtype) + state_messages(model) \
        + model.calibration.describe()
    if opts.fp8_kv_calibration_tokens is not None and model.calibration.fp8.source is None:
        runner.messages.append("fp8 KV scales: none (--fp8-kv-calibration-tokens calibrates an fp8 side; "
                               "no layer's K or V side is fp8)")
    cold = [e for e in getattr(loader, "events", []) if e.cold]
    if cold:
        runner.messages.append(f"compiled {len(cold)} kernel module(s) in "
                               f"{sum(e.seconds for e in cold):.1f} s (cached for the next start)")
    runner.messages.append(decode_mode)
    if tp.size > 1:
        group = "NCCL" if device.type == "cuda" else "gloo"
        if tp.one_shot is not None:
            group += f"; one-shot sums and gathers of up to {tp.one_shot.capacity / 2**10:.0f} KiB"
        runner.messages.append(f"tensor parallel: {tp.size} ranks ({group}), "
                               f"this rank holds {model.weight_bytes() / 2**20:.1f} MiB of weights")
    if dtype_line:
        runner.messages.append(dtype_line)
    return runner
