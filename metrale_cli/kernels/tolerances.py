"""The one tolerance table of kernel comparisons: ``validate-kernels``' numeric checks and the
tests use its rows. A value passes when |got - want| <= atol + rtol·|want| everywhere.
"""

from __future__ import annotations

from typing import NamedTuple


class Tolerance(NamedTuple):
    atol: float
    rtol: float
    why: str


TOLERANCES: dict[str, Tolerance] = {
    "store": Tolerance(0.0, 0.0, "cache writes reproduce the torch codecs' bytes by contract (docs/kv-formats.md)"),
    "wht": Tolerance(0.0, 0.0, "the same fp32 butterflies in the same order, one bf16 rounding"),
    "rope": Tolerance(0.0, 0.0, "the same bf16 rounding steps as the reference"),
    "norm": Tolerance(1e-2, 8e-3, "<= 1 bf16 ulp: fp32 reduction order and rsqrt differ"),
    "silu": Tolerance(1e-3, 8e-3, "<= 1 bf16 ulp: expf vs torch's exp"),
    "gemv": Tolerance(1e-2, 8e-3, "fp32 sums in another order than an fp64 product, one bf16 rounding"),
    "gemv swiglu": Tolerance(2e-2, 2e-2, "the projection's bf16 rounding carried through SiLU and the product"),
    "attention": Tolerance(2e-2, 2e-2, "K/V dequantize to the very values the reference reads (same fp32 "
                           "products); fp32 online softmax (exp2) vs fp32 softmax, output rounded to bf16"),
    "moe route": Tolerance(1e-6, 1e-5, "the router's fp32 softmax with expf vs torch's exp, the top-k sum in "
                           "another order"),
    "moe": Tolerance(2e-2, 2e-2, "gate, up, SiLU, down and the weighted products rounded to bf16 as the "
                     "reference rounds them; a row's k products summed in fp32 and rounded once, not in bf16"),
    "gdn": Tolerance(2e-2, 2e-2, "the conv, q / k / v, o and the gated norm rounded to bf16 where the reference "
                     "rounds them; fp32 sums over taps, Dk and Dv in another order (with FMA on the GPU) can move "
                     "a value across a bf16 rounding edge, and the fp32 state carries that into later steps"),
    "round trip": Tolerance(5e-2, 2e-2, "R^T(R x) = x up to two bf16 roundings of rotated values"),
}


def bounds(name: str) -> tuple[float, float]:
    """(atol, rtol) of a row."""
    row = TOLERANCES[name]
    return row.atol, row.rtol
