"""Profile the whole-stack decode kernel (decode_stack.cu beside this file) on random weights (GPU only).

    python -m tools.decode_stack.profile                  # Qwen3-0.6B's shape, context 600
    python -m tools.decode_stack.profile --poll 0 200 1000
    python -m tools.decode_stack.profile --trace
    python -m tools.decode_stack.profile --variant "STACK_PIECE_BYTES=0" --trace

Times a step as 20 launches back to back. ``--variant`` compiles and times the module with other
defines; ``--poll`` is short for variants with other back-offs between polls of flagged words
(STACK_POLL_NS). ``--trace`` compiles the profiling build (STACK_TRACE) of each variant: each CTA
records its clock at every phase boundary, and the per-layer phase times are printed as means
over CTAs (and the slowest CTA's).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from tools.decode_stack.stack import MODULE, STACK_BLOCK, STACK_SMEM_BYTES, make_stack_case, plan, stack_to

PHASES = ("stage q/k/v", "q/k/v GEMV", "attention", "stage o_proj", "o_proj GEMV", "stage gate/up",
          "gate/up GEMV", "down")
TRACE_CTAS, TRACE_EVENTS = 256, 1024  # STACK_TRACE_CTAS, STACK_TRACE_EVENTS


def _launcher(args, defines):
    """A function launching a build of the module with ``defines`` on one random stack, and that build."""
    import cupy as cp

    c = make_stack_case(args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim, args.inter,
                        args.context, seed=1)
    stack = stack_to(c["stack"], "cuda")
    planned = plan(stack)
    if planned is None:
        raise SystemExit("the planner does not take this shape (stack.stack_unserved says why)")
    raw = cp.RawModule(code=MODULE.path.read_text(), options=MODULE.options() + tuple(defines), backend="nvrtc")
    fn = raw.get_function("decode_stack_bf16")
    fn.max_dynamic_shared_size_bytes = STACK_SMEM_BYTES
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tables = c["block_tables"].cuda()
    splits = planned.splits(sms, tables.shape[1])
    tensors = [planned.table, len(stack.layers), c["hidden"].cuda(), planned.words, planned.part_o, planned.part_ml, planned.sync,
               tables[0].contiguous(), *(c[n].cuda() for n in ("seq_lens", "slot_mapping", "positions")),
               planned.cos, planned.sin]
    params = [np.uint64(t.data_ptr()) if isinstance(t, torch.Tensor) else np.int32(t) for t in tensors]
    params += [np.int32(x) for x in (planned.hidden, args.heads, args.kv_heads, args.head_dim, planned.rot_dim,
                                     planned.inter, splits)]
    params += [np.float32(1e-6), np.float32(args.head_dim**-0.5)]

    def launch(times: int = 1, _alive=(tensors, planned)) -> None:  # the buffers live as long as it
        for _ in range(times):
            fn((sms,), (STACK_BLOCK,), tuple(params), shared_mem=STACK_SMEM_BYTES)

    return launch, raw, sms


def step_us(args, defines) -> float:
    import cupy as cp

    launch, _, _ = _launcher(args, defines)
    launch(3)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    launch(20)
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 20 * 1000


def trace(args, defines=()) -> None:
    import cupy as cp

    launch, raw, sms = _launcher(args, ("-DSTACK_TRACE", *defines))
    launch(1)
    cp.cuda.runtime.deviceSynchronize()
    clock_hz = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0) * 1e3
    clocks = cp.ndarray((TRACE_CTAS, TRACE_EVENTS), dtype=cp.int64, memptr=raw.get_global("stack_trace")).get()[:sms]
    events = clocks[:, : 1 + len(PHASES) * args.layers].astype(np.float64)
    per = (np.diff(events, axis=1) / clock_hz * 1e6).reshape(sms, args.layers, len(PHASES))
    inner = per[:, 1:-1] if args.layers > 2 else per  # the first and last layers start and end the launch
    print(f"traced launch: {((events[:, -1] - events[:, 0]) / clock_hz * 1e6).mean():.1f} us (mean over CTAs)")
    for i, name in enumerate(PHASES):
        by_cta = inner[:, :, i].mean(axis=1)
        print(f"  {name:14s} {by_cta.mean():6.2f} us a layer, slowest CTA {by_cta.max():6.2f}")


def _defines(variant: str) -> tuple[str, ...]:
    """'A=1 B=2' -> ('-DA=1', '-DB=2')."""
    return tuple(f"-D{d}" for d in variant.split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 28), ("hidden", 1024), ("heads", 16), ("kv-heads", 8), ("head-dim", 128),
                          ("inter", 3072), ("context", 600)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--poll", type=int, nargs="*", help="back-offs in ns (STACK_POLL_NS) to time")
    parser.add_argument("--variant", action="append", default=[],
                        help="a build to time, as space-separated NAME=VALUE defines (repeatable), e.g. "
                             "'STACK_PIECE_BYTES=4096 STACK_PACE_NS=200'")
    parser.add_argument("--trace", action="store_true", help="per-phase clock trace of one launch")
    args = parser.parse_args()
    variants = [f"STACK_POLL_NS={ns}" for ns in args.poll or ()] + args.variant
    print(f"{step_us(args, ()):.1f} us a step (the module as built)")
    for variant in variants:
        print(f"{step_us(args, _defines(variant)):.1f} us a step, {variant}", flush=True)
    if args.trace:  # each variant's build, or the module as built
        for variant in variants or [""]:
            print(f"trace: {variant or 'the module as built'}")
            trace(args, _defines(variant))


if __name__ == "__main__":
    main()
