"""tools/decode_timeline.py's arithmetic on marks made up on the CPU: the hop into each launch, its
span and its marks, and a launch with no marks left out of the chain."""

import numpy as np
import pytest

from tools import decode_timeline as tl


def _stamps(layers: int, hop_ns: int, span_ns: int, skip=None):
    """Every CHAIN launch but ``skip`` in every layer: CTA c waits until 10 ns * c after the hop,
    reaches mark 2 500 ns after its wait (CTA 0 never does) and ends span_ns after the first wait."""
    stamps = {m: np.zeros((tl.KINDS, tl.LAUNCHES, tl.CTAS, tl.MARKS), dtype=np.uint64) for m in tl.TIMED}
    t = 10**6
    for layer in range(layers):
        for module, kind, _ in tl.CHAIN:
            if (module, kind) == skip:
                continue
            first = t + hop_ns
            for c in range(4):
                row = stamps[module][kind, layer, c]
                row[0], row[1], row[5] = first - 2000, first + 10 * c, first + span_ns - 30 + 10 * c
                if c:
                    row[2] = first + 10 * c + 500
            t = first + span_ns
    return stamps


def test_hops_spans_and_marks():
    stamps = _stamps(8, hop_ns=400, span_ns=3000)
    chain = [k for k in tl.CHAIN if tl._launch(stamps[k[0]][k[1], 1]) is not None]
    assert chain == list(tl.CHAIN)
    rows, hops = tl._per_layer(stamps, chain, 8)
    assert np.allclose(hops, 0.4)
    for key in chain:
        r = rows[key]
        assert len(r) == 5 and r[0]["ctas"] == 4
        assert np.allclose([x["end"] - x["first"] for x in r], 3.0)
        if key != chain[0]:
            assert np.allclose([x["hop"] for x in r], 0.4)
        assert r[0]["spread"] == pytest.approx(0.015)  # the median of 0, 10, 20, 30 ns
        assert r[0]["med"][0] == pytest.approx(0.5) and np.isnan(r[0]["med"][1])


def test_a_launch_without_marks_is_left_out():
    stamps = _stamps(4, 400, 3000, skip=("moe", 3))
    assert tl._launch(stamps["moe"][3, 1]) is None
    chain = [k for k in tl.CHAIN if tl._launch(stamps[k[0]][k[1], 1]) is not None]
    assert [k[2] for k in tl.CHAIN if k not in chain] == ["moe_down_one"]


def test_the_row_marks_build_s_extra_marks_are_read():
    """--row-marks: nine marks a CTA; the attention's marks 6-8 (its staged rows) follow 2-5."""
    m = np.zeros((3, tl.ROW_MARKS), dtype=np.uint64)
    for c in range(3):
        m[c, :6] = [1000, 2000 + c, 2500 + c, 3000 + c, 0, 4000]
        m[c, 6:] = [2100 + c, 2200 + c, 0 if c else 2300]
    r = tl._launch(m)
    assert len(r["med"]) == tl.ROW_MARKS - 2
    assert r["med"][4:6] == [pytest.approx(0.1), pytest.approx(0.2)]
    assert r["med"][6] == pytest.approx(0.3) and r["slow"][6] == pytest.approx(0.3)  # one CTA reached it
    assert np.isnan(r["med"][2])  # mark 4 never reached


def test_a_head_dim_256_layer_times_the_wide_module_s_attention():
    """Qwen3-Next's attention (head_dim 256) runs in paged_decode_tc_wide, whose marks are read too."""
    assert "paged_decode_tc_wide" in tl.TIMED
    assert [k[0] for k in tl.chain_for(256)] == ["gemv", "paged_decode_tc_wide", "gemv", "moe", "moe", "moe"]
    assert tl.chain_for(128) == tl.CHAIN


def test_a_gated_deltanet_layer_times_its_mixer_s_three_launches():
    """--gdn: the in-projection, gdn_decode_one_bf16 (gdn's kind 1) and the out-projection in
    place of q/k/v, the attention and o_proj; the MoE launches after them as before."""
    assert "gdn" in tl.TIMED
    assert [k[:2] for k in tl.chain_for(128, gdn=True)] == [("gemv", 0), ("gdn", 1), ("gemv", 1), ("moe", 0),
                                                            ("moe", 1), ("moe", 3)]
