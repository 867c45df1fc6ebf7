"""The bench command's library: ppN / tgN timings, achieved bandwidth, roofline, HF comparison.

Decode steps are timed as ``generate`` runs them (greedy sampling on the device, the host reading
step t's tokens while the GPU runs step t + 1), with CUDA events on a GPU. The roofline of a decode step is the bytes it must read:
every weight it uses whole once (the layers, the final norm, the LM head; an untied input
embedding gives one row per token, left out), the routed experts of a MoE model that the step
actually read (counted on the device), plus each sequence's cached K/V and, in a hybrid, the
recurrent state its Gated DeltaNet layers read (the conv's K - 1 inputs and the fp32 state; the
state written back is not counted), over the peak bandwidth (measured as a device-to-device copy
unless given).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import torch

from metrale_cli.commands.bench_presets import DESCRIPTIONS, PRESETS, random_weights
from metrale_cli.commands.timing import Timer, measure_copy_bandwidth, timing_row
from metrale_cli.engine.runner import (DTYPES, RunnerOptions, check_memory_fraction, fraction_blocks, open_runner,
                                       resolve_backend, resolve_dtype)
from metrale_cli.engine.room import check_room, weight_bytes
from metrale_cli.engine.sampler import Sampler, SamplingParams
from metrale_cli.engine.sequence import Sequence
from metrale_cli.engine.source import ModelSource
from metrale_cli.environment import build_info
from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import AUTO, KvCacheDtype, parse_kv_cache_dtype
from metrale_cli.kv.pool import BLOCK_SIZE
from metrale_cli.layers.gdn import GDN_RANGE
from metrale_cli.output import Output, SilentOutput
from metrale_cli.layers.parallel import SINGLE, TensorParallel
from metrale_cli.models import hold_once, model_config
from metrale_cli.models.family import weight_names
from metrale_cli.models.sharding import Sharder, shard_config


@dataclass(frozen=True)
class BenchOptions:
    model: str | None = None
    preset: str | None = None
    n_prompt: int = 512
    n_gen: int = 128
    batch: int = 1
    repetitions: int = 3
    kv_cache_dtypes: tuple[KvCacheDtype | str, ...] = (AUTO,)
    backend: str = "auto"
    dtype: str = "bf16"
    peak_bandwidth_gbs: float | None = None
    compare_hf: bool = False
    gpu_memory_utilization: float = 0.9
    cuda_graph_mode: str = "full"
    all_reduce: str = "nccl"  # tensor-parallel ranks' sums: nccl | one-shot (engine/runner.py)
    profile: bool = False
    kv_high_precision_layers: str = "0"
    innerq_calibration_tokens: int | None = None
    synthetic_context: bool = False  # fill the cache with random K/V instead of prefilling


def _time_run(runner, opts: BenchOptions, seed: int) -> tuple[float, float, float]:
    """One repetition: (prefill seconds of one n_prompt sequence, mean decode step seconds, mean
    bytes of routed experts a decode step read)."""
    engine, device = runner.engine, runner.model.device
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size
    seqs = [Sequence(i, torch.randint(0, vocab, (opts.n_prompt,), generator=gen).tolist(), opts.n_gen + 1)
            for i in range(opts.batch)]
    prefill_s = []
    for s in seqs:
        with Timer(device) as t:
            if opts.synthetic_context:
                fill_context(runner, s, gen)
            else:
                s.output_ids.append(int(engine.prefill(s).argmax(-1)[0]))
        prefill_s.append(t.seconds)
    routed = runner.model.routed_bytes()
    with Timer(device) as t, torch.profiler.record_function(DECODE_RANGE):
        engine.decode_steps(seqs, opts.n_gen, Sampler(SamplingParams(), device))
    routed = runner.model.routed_bytes() - routed
    for s in seqs:
        engine.release(s)
    return statistics.median(prefill_s), t.seconds / opts.n_gen, routed / opts.n_gen


def fill_context(runner, seq: Sequence, gen: torch.Generator, chunk: int = 4096) -> None:
    """Write random K/V for the sequence's prompt positions into every layer's cache (through
    the same cache-write kernels as prefill) and pick a random next token: decode timing at long
    contexts without paying for a quadratic prefill. Values are N(0, 1), as K/V are after norms."""
    model, n = runner.model, len(seq.prompt_ids)
    model.kv_cache.ensure_capacity(seq.block_table, n + 1)
    seq.states = model.alloc_states()
    table = torch.tensor(seq.block_table, dtype=torch.long)
    for start in range(0, n, chunk):
        pos = torch.arange(start, min(n, start + chunk))
        slots = (table[pos // 16] * 16 + pos % 16).to(torch.int32).to(model.device)
        for layer in model.layers:
            if not layer.spec.has_kv:  # a recurrent layer: no KV to fill
                continue
            shape = (len(pos), layer.kv.num_kv_heads, layer.kv.head_dim)
            k = torch.randn(shape, device=model.device, dtype=model.dtype)
            v = torch.randn(shape, device=model.device, dtype=model.dtype)
            layer.attention.reshape_and_cache(k, v, layer.kv, slots)
    seq.output_ids.append(int(torch.randint(0, model.cfg.vocab_size, (1,), generator=gen)))


_PROFILES: dict[str, str] = {}
DECODE_RANGE = "metrale.decode_steps"  # the profiler range of a repetition's decode steps


def profile_run(runner, opts: BenchOptions, rows: int = 15) -> str:
    """One more repetition under the torch profiler: the top kernels by device time and, on a GPU,
    the decode step's critical path; with tensor parallelism, then the all-reduce time of a step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, acc_events=True) as prof:  # one cycle; no "clears events" warning
        _time_run(runner, opts, seed=99)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
    if cuda:
        table += "\n" + critical_path_table(decode_kernels(prof.events()), opts.n_gen, rows)
    if runner.model.tp.size == 1:
        return table
    calls, seconds = all_reduce_time(prof.events(), cuda)
    return table + (f"\nall-reduce in the decode steps: {calls / opts.n_gen:.0f} a step, "
                    f"{seconds / opts.n_gen * 1e6:.1f} µs a step ({'device' if cuda else 'host'} time, "
                    f"{runner.model.tp.size} ranks)")


def decode_kernels(events) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of the device work (kernels, copies) inside the profiler's decode
    range, from its device-side record."""
    from torch.autograd import DeviceType

    device = [e for e in events if e.device_type == DeviceType.CUDA]
    ranges = [e.time_range for e in device if e.name == DECODE_RANGE]
    return [(e.name, e.time_range.start, e.time_range.end) for e in device
            if e.name != DECODE_RANGE and any(r.start <= e.time_range.start < r.end for r in ranges)]


def critical_path(kernels: list[tuple[str, float, float]]) -> tuple[dict[str, tuple[int, float]], float]:
    """Each name's (launches, µs on the critical path) and the µs with nothing running. A kernel's
    share is the part of its span past the end of everything that started before it: a kernel
    launched programmatically starts while the one before it runs, so its own span counts that
    overlap twice; this way the shares and the idle time add up to the range's length."""
    shares: dict[str, tuple[int, float]] = {}
    idle, reach = 0.0, None
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if reach is not None and start > reach:
            idle += start - reach
        launches, total = shares.get(name, (0, 0.0))
        shares[name] = launches + 1, total + max(0.0, end - (start if reach is None else max(start, reach)))
        reach = end if reach is None else max(reach, end)
    return shares, idle


def critical_path_table(kernels: list[tuple[str, float, float]], steps: int, rows: int) -> str:
    """:func:`critical_path` of a repetition's decode steps, per step, the largest shares first."""
    shares, idle = critical_path(kernels)
    total = sum(t for _, t in shares.values()) + idle
    if not total:
        return "critical path of a decode step: no device work recorded"
    lines = [f"critical path of a decode step ({total / steps:.1f} µs; each kernel's time past the end of "
             f"those before it):", f"{'µs a step':>10}  {'share':>6}  {'launches':>8}  kernel"]
    ranked = sorted(shares.items(), key=lambda kv: -kv[1][1])[:rows] + [("(no kernel running)", (0, idle))]
    for name, (launches, t) in ranked:
        lines.append(f"{t / steps:10.1f}  {t / total:6.1%}  {launches / steps:8.1f}  {name[:70]}")
    return "\n".join(lines)


def all_reduce_time(events, cuda: bool) -> tuple[int, float]:
    """(calls, seconds) of the all-reduces of the profiler's decode range: on a GPU the NCCL
    all-reduce kernels or the one-shot sums (``--all-reduce one-shot``) launched under it (device
    time), on the CPU the gloo calls that ran while it did (host time: gloo runs them on threads of
    its own)."""
    events = list(events)
    ranges = [e.time_range for e in events if e.name == DECODE_RANGE]
    calls, seconds = 0, 0.0
    for event in events:
        if cuda:
            parent, inside = event.cpu_parent, False
            while parent is not None and not inside:
                inside, parent = parent.name == DECODE_RANGE, parent.cpu_parent
            for kernel in event.kernels if inside else ():
                name = kernel.name.lower()
                if ("nccl" in name and "allreduce" in name.replace("_", "")) or "one_shot_sum" in name:
                    calls, seconds = calls + 1, seconds + kernel.duration / 1e6
        elif event.name == "gloo:all_reduce" and any(r.start <= event.time_range.start <= r.end for r in ranges):
            calls, seconds = calls + 1, seconds + (event.time_range.end - event.time_range.start) / 1e6
    return calls, seconds


GEMM_KERNELS = ("gemm", "cutlass", "nvjet", "xmma", "grouped_mm")  # cuBLAS / CUTLASS kernel names


def prefill_split(runner, n_prompt: int, seed: int = 98) -> dict:
    """One more prefill of ``n_prompt`` tokens under the torch profiler, its device time split
    three ways (:func:`split_device_time`). Seconds; a cuda run of a hybrid only."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(seed)
    seq = Sequence(0, torch.randint(0, runner.config.vocab_size, (n_prompt,), generator=gen).tolist(), 2)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        runner.engine.prefill(seq)
        torch.cuda.synchronize()
    runner.engine.release(seq)
    with tempfile.TemporaryDirectory() as folder:  # the trace has every kernel, CuPy's launches included
        path = f"{folder}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return split_device_time(trace["traceEvents"] if isinstance(trace, dict) else trace)


def split_device_time(events: list[dict]) -> dict:
    """A chrome trace's device time split three ways: the Gated DeltaNet mixers (what was launched
    inside a ``GDN_RANGE`` range: conv, the chunked rule, the gated norm, their batched GEMMs),
    the GEMMs outside them (projections, experts, LM head) and the rest (attention, norms,
    routing, copies). Every kernel, copy and memset counts, whoever launched it: CuPy's launches
    (through the driver) have no torch op above them, so they are placed by their launch call's
    time. Seconds."""
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "user_annotation" and e.get("name") == GDN_RANGE]
    split = {"gdn_mixer_s": 0.0, "gemm_s": 0.0, "other_s": 0.0}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        at = launches.get(e.get("args", {}).get("correlation"))
        inside = at is not None and any(lo <= at <= hi for lo, hi in ranges)
        key = "gdn_mixer_s" if inside else "gemm_s" if any(n in e["name"].lower() for n in GEMM_KERNELS) \
            else "other_s"
        split[key] += e["dur"] / 1e6
    return split


def _step_bytes(runner, opts: BenchOptions) -> float:
    """Bytes one decode step reads at the middle of the tg run: the weights it reads whole +
    every sequence's KV and recurrent state (the routed experts it read are counted by the run)."""
    ctx = opts.n_prompt + opts.n_gen // 2
    model = runner.model
    per_sequence = ctx * model.kv_cache.layout.bytes_per_token() + model.state_read_bytes()
    return model.weight_bytes() + opts.batch * per_sequence


def bench_metrale(runner, opts: BenchOptions, peak: float | None) -> list[dict]:
    _time_run(runner, opts, seed=0)  # warm-up at the timed shapes (kernel loads, allocator, clocks)
    runs = [_time_run(runner, opts, seed=r + 1) for r in range(opts.repetitions)]
    graphs = "graphs" if runner.engine.graphs.capture else "eager"
    name = f"metrale {runner.backend} {graphs} kv={runner.kv_dtype.value}"
    routed = statistics.mean(r[2] for r in runs)
    step_bytes = _step_bytes(runner, opts) + routed
    decode = f"tg{opts.n_gen} b{opts.batch} @{opts.n_prompt}"
    if opts.profile:  # a sweep profiles each of its points
        _PROFILES[f"{name} {decode}"] = profile_run(runner, opts)
    rows = [] if opts.synthetic_context else [
        timing_row(name, f"pp{opts.n_prompt}", [r[0] for r in runs], opts.n_prompt, None, peak)]
    if rows and runner.model.ssm_pool is not None and runner.model.device.type == "cuda":
        rows[0] |= prefill_split(runner, opts.n_prompt)
    rows.append(timing_row(name, decode, [r[1] for r in runs],
                     opts.batch, step_bytes, peak) | ({"routed_bytes_per_step": routed} if routed else {}))
    memory = kv_memory(runner, opts.gpu_memory_utilization)
    return [r | memory for r in rows]


def kv_memory(runner, utilization: float) -> dict:
    """KV bytes per token (all layers, K and V) and how many tokens the pool holds: the pool
    built for this run and, on a GPU, the pool `generate` would build at --gpu-memory-utilization
    ``utilization`` beside these weights (this run's own pool counted as free: it would take its
    place)."""
    cache = runner.model.kv_cache
    memory = {"kv_bytes_per_token": cache.layout.bytes_per_token(), "pool_tokens": cache.capacity_tokens}
    if runner.model.device.type == "cuda":
        blocks = fraction_blocks(cache.layout, utilization, runner.model.device,
                                 freed=cache.num_blocks * cache.layout.bytes_per_block())
        memory |= {"gpu_memory_utilization": utilization, "utilization_pool_tokens": blocks * BLOCK_SIZE}
    return memory


def _check_context(cfg, cases) -> None:
    """Every (prompt, generated, batch) case inside the model's context, before a weight is drawn or read."""
    for n_prompt, n_gen, _ in cases:
        if n_prompt + n_gen + 1 > cfg.max_position_embeddings:
            raise MetraleError(f"-p {n_prompt} -n {n_gen} needs {n_prompt + n_gen + 1} positions, past the model's "
                               f"context of {cfg.max_position_embeddings} tokens (max_position_embeddings)",
                               hint=f"keep -p + -n at most {cfg.max_position_embeddings - 1}")


def bench_source(opts: BenchOptions, device: torch.device, tp: TensorParallel = SINGLE,
                 cases: list[tuple[int, int, int]] = ()) -> tuple[ModelSource, str]:
    """A preset's random weights at a real model's shapes, or a checkpoint loaded once for every
    dtype; and the --dtype they are in (``auto`` resolved against the config). A tensor-parallel
    rank holds its shard only: a preset's drawn at the shard's shapes, a checkpoint's tensors cut
    to the rank's part as they are read. ``cases``: checked against the model's context first."""
    if opts.preset:
        if opts.preset not in PRESETS:
            raise MetraleError(f"unknown --preset '{opts.preset}'", hint="presets: " + ", ".join(PRESETS))
        raw, about = PRESETS[opts.preset], DESCRIPTIONS.get(opts.preset)
        name = f"{opts.preset} (random weights{'; ' + about if about else ''})"
        dtype, _ = resolve_dtype(opts.dtype, raw)
        cfg = model_config(raw)
        _check_context(cfg, cases)
        shard = shard_config(cfg, tp)
        check_room(f"--preset {opts.preset}", weight_bytes(shard, DTYPES[dtype]), device, tp, "preset")
        return ModelSource.loaded(raw, random_weights(raw, device, DTYPES[dtype], tp=tp), None, name,
                                  sharded=tp.size > 1), dtype
    checkpoint = ModelSource.checkpoint(opts.model)
    dtype, _ = resolve_dtype(opts.dtype, checkpoint.config)
    cfg = model_config(checkpoint.config)
    _check_context(cfg, cases)
    shard = shard_config(cfg, tp)
    check_room("the model", weight_bytes(shard, DTYPES[dtype]), device, tp)
    weights = checkpoint.load(device, DTYPES[dtype], None, transform=Sharder(cfg, tp) if tp.size > 1 else None)
    if device.type == "cuda":  # (on the CPU they are maps of the file, which a copy would only add to)
        hold_once(shard, weights.tensors)  # every dtype's build (and HF's) takes views of them
    return ModelSource.loaded(checkpoint.config, weights.tensors, weights.tokenizer, weights.name,
                              sharded=tp.size > 1), dtype


def run_bench(opts: BenchOptions, out: Output | None = None,
              sweep: list[tuple[int, int, int]] | None = None, tp: TensorParallel = SINGLE,
              progress: dict | None = None) -> dict:
    """Every (prompt tokens, generated tokens, batch) case of ``sweep`` (default: the options'
    own), each for every requested KV dtype, on one load of the weights. As a tensor-parallel
    rank (``tp``): the rank's shard, its weight bytes and roofline those of one GPU. ``progress``
    (a dict) holds under "result" the result with the rows measured so far, for a caller whose run
    a later case's error stops."""
    cases = sweep or [(opts.n_prompt, opts.n_gen, opts.batch)]
    if opts.repetitions < 1:
        raise MetraleError(f"--repetitions must be at least 1, got {opts.repetitions}", hint="e.g. -r 3")
    if min(v for case in cases for v in case) < 1:
        raise MetraleError("-p, -n and --batch must all be at least 1", hint="e.g. -p 512 -n 128 --batch 1")
    check_memory_fraction(opts.gpu_memory_utilization)
    if opts.peak_bandwidth_gbs is not None and not 0 < opts.peak_bandwidth_gbs < math.inf:
        raise MetraleError(f"--peak-bandwidth must be a finite positive GB/s figure, got {opts.peak_bandwidth_gbs:g}",
                           hint="leave it out to measure the device-to-device copy")
    if opts.preset and opts.model:
        raise MetraleError("give -m (a checkpoint) or --preset (random weights at a model's shapes), not both",
                           hint="drop one of the two")
    if opts.compare_hf and tp.size > 1:
        raise MetraleError("--compare-hf times HF transformers on one device, not with --tensor-parallel-size",
                           hint="compare at --tensor-parallel-size 1")
    requested = [parse_kv_cache_dtype(name) for name in opts.kv_cache_dtypes]
    backend, device = resolve_backend(opts.backend)
    source, dtype = bench_source(opts, device, tp, cases)
    peak = opts.peak_bandwidth_gbs or measure_copy_bandwidth(device)
    weights = source.load(device, DTYPES[dtype], None)
    names = weight_names(model_config(source.config), weights.tensors)  # not a tied model's stored lm_head copy
    model = [t for name, t in weights.tensors.items() if name in names]
    result = {"model": weights.name, "device": _device_name(device), "peak_bandwidth_gbs": peak, "profiles": {},
              "weight_bytes": sum(t.numel() * t.element_size() for t in model), "params": sum(t.numel() for t in model),
              "build": build_info(), "tensor_parallel_size": tp.size, "rows": []}
    if progress is not None:
        progress["result"] = result
    _PROFILES.clear()
    for n_prompt, n_gen, batch in cases:
        case = dataclasses.replace(opts, n_prompt=n_prompt, n_gen=n_gen, batch=batch)
        _bench_case(case, source, weights, requested, backend, device, dtype, peak, out, tp, result["rows"])
    result["profiles"] = dict(_PROFILES)
    _PROFILES.clear()
    return result


def _bench_case(opts: BenchOptions, source, weights, requested, backend, device, dtype, peak, out,
                tp: TensorParallel, rows: list[dict]) -> None:
    """One (prompt, generated, batch) case for every requested KV dtype (and HF with
    --compare-hf), its rows appended to ``rows`` as each is measured."""
    first = len(rows)
    for kv in requested:
        ropts = RunnerOptions(backend=backend, kv_cache_dtype=kv, dtype=dtype, max_num_seqs=opts.batch,
                              max_seq_len=opts.n_prompt + opts.n_gen + 1, reserve_all_memory=False,
                              prefill_chunk=max(opts.n_prompt, 1),
                              cuda_graph_mode=opts.cuda_graph_mode, all_reduce=opts.all_reduce,
                              kv_high_precision_layers=opts.kv_high_precision_layers,
                              innerq_calibration_tokens=opts.innerq_calibration_tokens)
        runner = open_runner(ropts, source, tp=tp)
        if out:
            out.info(f"timing {runner.source} · {backend} · kv {runner.kv_dtype.value} · {runner.messages[0]}")
        rows += bench_metrale(runner, opts, peak)
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if opts.compare_hf:
        from metrale_cli.commands.bench_hf import bench_hf

        hf_rows = bench_hf(source.config, weights.tensors, opts, device, peak)
        hf_tps = {r["test"]: r["tokens_per_s"] for r in hf_rows}
        for r in rows[first:]:
            r["vs_hf"] = r["tokens_per_s"] / hf_tps[r["test"]]
        rows += hf_rows


def _tokens(row: dict) -> str:
    """Pool capacity: the tokens a pool at --gpu-memory-utilization would hold, else the run's pool."""
    if "utilization_pool_tokens" in row:
        return f"{row['utilization_pool_tokens']:,} (at {row['gpu_memory_utilization']:g} of memory)"
    return f"{row['pool_tokens']:,}" if "pool_tokens" in row else ""


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


OUTPUT_FORMATS = ("table", "md", "csv", "json", "jsonl")
COLUMNS = ["model", "size", "params", "engine", "test", "t/s", "GB/s", "% roofline", "vs HF", "KV B/token",
           "KV tokens"]


def _cells(result: dict, r: dict) -> list[str]:
    return [result["model"], f"{result['weight_bytes'] / 2**30:.2f} GiB", f"{result['params'] / 1e9:.2f} B",
            r["engine"], r["test"], f"{r['tokens_per_s']:.1f} ± {r['std']:.1f}",
            _gbs(r["achieved_gbs"]) if "achieved_gbs" in r else "",
            f"{r['roofline_pct']:.1f}%" if "roofline_pct" in r else "",
            f"{r['vs_hf']:.2f}x" if "vs_hf" in r else "", str(r.get("kv_bytes_per_token", "")), _tokens(r)]


def _gbs(gbs: float) -> str:
    """A bandwidth in GB/s: whole numbers from 10 up, two significant digits below (a CPU's
    decode reads a fraction of a GB/s, which a whole number would print as 0)."""
    return f"{gbs:.0f}" if gbs >= 10 else f"{gbs:.2g}"


def _build_line(result: dict) -> str:
    build = result["build"]
    return f"build: metrale {build['version']} ({build['commit'] or 'commit unknown'})"


def _per_rank(result: dict) -> str:
    """What a tensor-parallel run's rows say of one rank's shard, not of the model."""
    size = result["tensor_parallel_size"]
    return f"; size, params, GB/s and KV B/token per rank of {size} (tensor parallel)" if size > 1 else ""


def _render(out: Output, result: dict, fmt: str) -> None:
    """md / csv / jsonl: llama-bench's outputs, a row per test, the model's size and parameters
    in every row and the build (version and commit) with them."""
    if fmt == "json":
        out.json(result)
    elif fmt == "jsonl":
        import json

        for r in result["rows"]:
            out.stream(json.dumps({"model": result["model"], "weight_bytes": result["weight_bytes"],
                                   "params": result["params"], "device": result["device"],
                                   "tensor_parallel_size": result["tensor_parallel_size"], **result["build"], **r})
                       + "\n")
    elif fmt == "csv":
        import csv
        import sys

        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow([*COLUMNS, "device", "build", "tensor_parallel_size"])
        for r in result["rows"]:
            writer.writerow([*_cells(result, r), result["device"], _build_line(result).removeprefix("build: "),
                             result["tensor_parallel_size"]])
    else:  # md
        out.stream("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
        for r in result["rows"]:
            out.stream("| " + " | ".join(c.replace("|", "\\|") for c in _cells(result, r)) + " |\n")
        out.stream(f"\n{result['device']}{_per_rank(result)}; {_build_line(result)}\n")
        for line in split_lines(result):
            out.stream(f"\n{line}\n")


def split_lines(result: dict) -> list[str]:
    """A line per row that carries a hybrid prefill's device-time split (:func:`prefill_split`)."""
    lines = []
    for r in result["rows"]:
        if "gdn_mixer_s" in r:
            parts = {k: r[k] for k in ("gdn_mixer_s", "gemm_s", "other_s")}
            total = sum(parts.values())
            lines.append(f"{r['engine']} {r['test']}: device time of one prefill {total * 1e3:.1f} ms = Gated "
                         f"DeltaNet mixers {parts['gdn_mixer_s'] * 1e3:.1f} ms "
                         f"({100 * parts['gdn_mixer_s'] / total:.0f}%), GEMMs {parts['gemm_s'] * 1e3:.1f} ms "
                         f"({100 * parts['gemm_s'] / total:.0f}%), other {parts['other_s'] * 1e3:.1f} ms")
    return lines


def bench_rank(tp: TensorParallel, device, out: Output | None, opts: BenchOptions,
               sweep: list[tuple[int, int, int]] | None = None, fmt: str = "table") -> dict:
    """:func:`run_bench_cmd` as one tensor-parallel rank runs it (``engine.ranks.run_ranks``): every
    rank times the same steps, rank 0 writes them."""
    return run_bench_cmd(out or SilentOutput(), opts, sweep, fmt, tp)


def run_bench_cmd(out: Output, opts: BenchOptions, sweep: list[tuple[int, int, int]] | None = None,
                  fmt: str = "table", tp: TensorParallel = SINGLE) -> dict:
    if fmt not in OUTPUT_FORMATS:
        raise MetraleError(f"unknown -o '{fmt}'", hint="choose one of: " + ", ".join(OUTPUT_FORMATS))
    progress: dict = {}
    try:
        result = run_bench(opts, out, sweep, tp, progress)
    except BaseException:
        # a later case's error (a pool that does not fit, running out of memory, Ctrl-C): the rows
        # measured before it are shown, then the error line; one json document is not written in part
        partial = progress.get("result")
        if partial is not None and partial["rows"] and not out.json_mode and fmt != "json":
            _show(out, partial, fmt, tp, stopped=True)
        raise
    _show(out, result, "json" if out.json_mode else fmt, tp)
    return result


def _show(out: Output, result: dict, fmt: str, tp: TensorParallel, stopped: bool = False) -> None:
    """The result in ``fmt``; ``stopped``: the rows of a run that an error ended (the table says so)."""
    if fmt != "table":
        _render(out, result, fmt)
        return
    peak = result["peak_bandwidth_gbs"]
    rows = [_cells(result, r)[3:] for r in result["rows"]]
    caption = f"{result['device']}; weights {result['weight_bytes'] / 1e9:.2f} GB, {result['params'] / 1e9:.2f} B " \
              f"parameters" + (f" per rank of {tp.size} (tensor parallel)" if tp.size > 1 else "") \
        + (f"; roofline bandwidth {peak:.0f} GB/s" if peak else "") + f"; {_build_line(result)}"
    title = f"metrale bench: {result['model']}" + (" (stopped by the error below: the rows measured before it)"
                                                    if stopped else "")
    out.table(title, COLUMNS[3:], rows, caption)
    for line in split_lines(result):
        out.text(line)
    for name, table in result["profiles"].items():
        out.text(f"top kernels, {name} (one pp + tg repetition):\n{table}")
