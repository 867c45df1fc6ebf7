"""A/B kernel build variants on a batch-1 decode layer, in one process (GPU only; figures, no
asserts):

    python -m tools.layer_variants --variant MODULE:NAME=VALUE             # Qwen3-30B-A3B's layer
    python -m tools.layer_variants --variant MODULE:NAME=VALUE -- --hidden 4096 --kv-heads 8 \\
        --dense 12288 --layers 36                                         # Qwen3-8B's layer (after --)

Each variant is a module of the kernel registry rebuilt with extra defines (several in one variant:
module:NAME=V,NAME=V), macros its source reads under #ifndef; the base is the registry as it is. A
variant `py:MODULE.NAME=V` instead sets an integer constant of the module of metrale_cli.kernels
whose host code reads it (py:cuda_moe.MOE_GATE_UP_ONE_PER_SM=2, say); the base build keeps its
value. The layer and its launches are tools.moe_layer_launches' (its options after --), built once;
the variants take turns over --rounds rounds, so that a drift of the GPU's clock shows as a drift of
every column. Before the rounds each variant's outputs of the timed launches are compared with the
base build's, byte for byte, and the tool says whether they are equal (where the base build gives
the same bytes twice: a Gated DeltaNet layer advances its state at every call).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib

import torch

from metrale_cli.kernels import registry
from metrale_cli.kernels.cuda_ops import CudaOps
from tools import moe_layer_launches


def parse_defines(text: str, values: bool = False) -> tuple[tuple[str, str], ...]:
    """'NAME=V,NAME=V' -> ((NAME, V), ...); ``values``: an empty V is refused too."""
    pairs = tuple(tuple(d.split("=", 1)) for d in text.split(","))
    if any(len(p) != 2 or not p[0] or (values and not p[1]) for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: each define is NAME=VALUE")
    return pairs


def parse_variant(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """'module:NAME=V,NAME=V' -> (module, ((NAME, V), ...)); module "py": host constants,
    'py:cuda_moe.NAME=V'."""
    module, _, defines = text.partition(":")
    if module == "py" and defines:
        pairs = parse_defines(defines, values=True)
        for name, value in pairs:
            owner, attr = _constant(name)
            if not hasattr(owner, attr) or not value.lstrip("-").isdigit():
                raise argparse.ArgumentTypeError(f"{text!r}: expected py:MODULE.NAME=INTEGER, a constant of "
                                                 "a metrale_cli.kernels module")
        return module, pairs
    if module not in registry.MODULES or not defines:
        raise argparse.ArgumentTypeError(f"{text!r}: expected module:NAME=VALUE[,NAME=VALUE] with a registry module")
    return module, parse_defines(defines)


def _constant(name: str):
    """'module.NAME' -> (the module metrale_cli.kernels.module, 'NAME')."""
    module, _, attr = name.rpartition(".")
    try:
        return importlib.import_module(f"metrale_cli.kernels.{module}"), attr
    except ImportError:
        raise argparse.ArgumentTypeError(f"{module!r}: no such module in metrale_cli.kernels") from None


def use_build(ops: CudaOps, base: dict, defines: dict[str, tuple[tuple[str, str], ...]],
              host_base: dict[str, int] | None = None) -> None:
    """The registry as in ``base`` with each named module's extra defines (none: the base build),
    and ``ops``' loaded functions dropped so that the next launches load from it; the host
    constants of ``host_base`` ('module.NAME': value) at their base values, then a "py" variant's."""
    registry.MODULES.clear()
    registry.MODULES.update(base)
    for name, value in (host_base or {}).items():
        setattr(*_constant(name), value)
    for module, extra in defines.items():
        if module == "py":
            for name, value in extra:
                setattr(*_constant(name), int(value))
            continue
        m = base[module]
        registry.MODULES[module] = dataclasses.replace(m, defines=m.defines + extra)
    ops.loader._functions.clear()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", type=parse_variant, action="append", default=[])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--launch", action="append", default=None, help="launches to time (default: attention, whole layer)")
    p.add_argument("layer", nargs=argparse.REMAINDER, help="tools.moe_layer_launches options, after --")
    a = p.parse_args(argv)
    shape = moe_layer_launches.parser().parse_args([x for x in a.layer if x != "--"])
    base = dict(registry.MODULES)
    host_base = {name: getattr(*_constant(name)) for module, pairs in a.variant if module == "py" for name, _ in pairs}
    ops = CudaOps()
    launches = moe_layer_launches.build(shape, ops)
    names = a.launch or ["attention", "whole layer"]
    label = {None: "base"} | {v: f"{v[0]}:" + ",".join(f"{k}={x}" for k, x in v[1]) for v in a.variant}
    # each variant's outputs against the base build's, byte for byte, where the base build gives
    # the same bytes twice (a Gated DeltaNet layer's launches advance its state: not comparable)
    use_build(ops, base, {}, host_base)
    want = [outputs(launches[n](0)) for n in names]
    if not same_outputs([outputs(launches[n](0)) for n in names], want):
        print("outputs not compared: the base build's differ between two calls (the launches keep state)")
    else:
        for variant in a.variant:
            use_build(ops, base, dict([variant]), host_base)
            same = same_outputs([outputs(launches[n](0)) for n in names], want)
            print(f"{label[variant]:40s} outputs {'equal to' if same else 'DIFFER from'} the base build's", flush=True)
    for _ in range(a.rounds):
        for variant in [None, *a.variant]:
            use_build(ops, base, {} if variant is None else dict([variant]), host_base)
            print(f"{label[variant]:40s} " + "  ".join(f"{n} {moe_layer_launches._time(launches[n], shape.layers):7.2f}"
                                                     for n in names), flush=True)
    use_build(ops, base, {}, host_base)


def same_outputs(got: list, want: list) -> bool:
    return all(len(g) == len(w) and all(torch.equal(x, y) for x, y in zip(g, w)) for g, w in zip(got, want))


def outputs(result) -> list:
    """A launch's output tensors (a tensor or a tuple of them), copied before the next launch
    writes the same buffers."""
    items = result if isinstance(result, (tuple, list)) else [result]
    torch.cuda.synchronize()
    return [t.clone() for t in items if isinstance(t, torch.Tensor)]


if __name__ == "__main__":
    main()
