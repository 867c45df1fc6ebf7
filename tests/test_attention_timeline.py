"""tools/attention_timeline.py's arithmetic on marks made up on the CPU: the gap between launches,
each launch's span, and its marks from each CTA's start, the combine's only where a CTA made it."""

import numpy as np
import pytest

from tools import attention_timeline as at
from tools import decode_timeline as tl


def _marks(launches: int, gap_ns: int, span_ns: int) -> np.ndarray:
    """Four CTAs a launch: CTA c starts 10 ns * c after the launch's first, decodes in 3 µs, takes
    the counter 200 ns later; CTA 3 (the last split) combines 1 µs more; each ends span_ns after
    the first start less 30 ns * (3 - c)."""
    m = np.zeros((tl.LAUNCHES, tl.CTAS, tl.MARKS), dtype=np.uint64)
    t = 10**6
    for i in range(launches):
        for c in range(4):
            start = t + 10 * c
            m[i, c, :2] = start
            m[i, c, 2], m[i, c, 3] = start + 3000, start + 3200
            if c == 3:
                m[i, c, 4] = start + 4200
            m[i, c, 5] = t + span_ns - 30 * (3 - c)
        t += span_ns + gap_ns
    return m


def test_gap_span_and_marks():
    s = at.summarize(_marks(10, gap_ns=1500, span_ns=5000), 10)
    assert s["ctas"] == 4
    assert s["gap"] == pytest.approx(1.5) and s["span"] == pytest.approx(5.0)
    assert s["med"][:3] == pytest.approx([3.0, 3.2, 4.2]) and s["slow"][:3] == pytest.approx([3.0, 3.2, 4.2])
    assert s["slow"][3] == pytest.approx(4.97)  # the slowest end: CTA 3, 5 µs after the first start, 30 ns after it


def test_the_parser_takes_a_dtype_context_and_splits():
    a = at.parser().parse_args(["--kv-cache-dtype", "turbo4", "--context", "4096", "--splits", "16"])
    assert (a.kv_cache_dtype, a.context, a.splits, a.heads, a.kv_heads, a.head_dim) == ("turbo4", 4096, 16, 32, 8, 128)
    assert a.evict == 0 and at.parser().parse_args(["--evict", "256"]).evict == 256
