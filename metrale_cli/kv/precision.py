"""High-precision boundary layers: which layers keep bf16 KV (``--kv-high-precision-layers``).

N boundary layers keep bf16, the first ⌈N/2⌉ and the last ⌊N/2⌋ of the stack. Quantized KV
hurts most at the ends of the stack, and a turbo or asymmetric dtype promotes a minimum even at
N = 0 (KV_DTYPES.md): each dtype's row says how many (``KvDtypeRow.min_bf16_layers``).
"""

from __future__ import annotations

import math

from metrale_cli.errors import MetraleError
from metrale_cli.kv.dtypes import KV_DTYPES, KvCacheDtype

NAMED = {"auto": 2}
EVERY = ("max", "all")


def requested_layers(spec: str | int, num_layers: int) -> int:
    """N from ``N|auto|max|all`` (before the dtype's minimum)."""
    key = str(spec).strip().lower()
    if key in EVERY:
        return num_layers
    if key in NAMED:
        return NAMED[key]
    if not (key.isascii() and key.isdigit()):  # '²' is a digit int() refuses
        raise MetraleError(f"invalid --kv-high-precision-layers '{spec}'",
                           hint="give a number of layers, or auto (= 2), max or all")
    if int(key) > num_layers:  # capped, it would quietly run another plan than the one asked for
        raise MetraleError(f"--kv-high-precision-layers {int(key)}: the model has only {num_layers} layers "
                           "with a KV cache", hint="max or all keeps every layer's KV in bf16")
    return int(key)


def high_precision_count(dtype: KvCacheDtype, num_layers: int, spec: str | int = 0,
                         promote_minimum: bool = True) -> int:
    """How many boundary layers keep bf16: max(N, the dtype's minimum), at most every layer."""
    n = requested_layers(spec, num_layers)
    floor = KV_DTYPES[dtype].min_bf16_layers(num_layers) if promote_minimum else 0
    return min(num_layers, max(n, floor))


def layer_dtypes(dtype: KvCacheDtype, num_layers: int, spec: str | int = 0,
                 promote_minimum: bool = True) -> tuple[KvCacheDtype, ...]:
    """Each layer's KV dtype: bf16 for the first ⌈N/2⌉ and last ⌊N/2⌋ layers, else ``dtype``."""
    n = high_precision_count(dtype, num_layers, spec, promote_minimum)
    head, tail = math.ceil(n / 2), n // 2
    return tuple(KvCacheDtype.BF16 if i < head or i >= num_layers - tail else dtype for i in range(num_layers))


def describe(dtypes: tuple[KvCacheDtype | None, ...]) -> str:
    """'bf16 layers 0-1, turbo3 layers 2-27, bf16 layers 28-29' (runs of equal dtypes; a layer
    without KV, None, is skipped: a run spans the KV layers between its ends)."""
    runs: list[list] = []
    for i, d in enumerate(dtypes):
        if d is None:
            continue
        if runs and runs[-1][0] == d:
            runs[-1][2] = i
        else:
            runs.append([d, i, i])
    return ", ".join(f"{d.value} layer{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}"
                     for d, a, b in runs)
