"""gdn.cu's decode kernel emulated on the CPU against ``gdn_reference.decode`` (Ops.gdn_decode's oracle).

``CudaOps.gdn_decode`` itself runs, its launch handed to ``kernels_cu/host/gdn_host.cpp``, which
runs gdn_decode_bf16 over the launch's grid and block with the arguments as the signature types
them: so the host side (shape checks, the inputs' rows read in place at their strides, the
argument order) is tested with the kernel. The cases of ``tests/gdn_cases.py``: 1, 3 and 7 rows,
padding rows sharing the scratch slot; 1 to 4 key heads with 1, 2 or 3 value heads each; Dk = Dv
and Dk != Dv both ways (16 to 128); K = 4 and 2; positions 0, 1, 2 and 5, the window's entries
wrapping over several steps of the same rows, state and window carried from step to step. Every
step's outputs and, at the end, the pools are held to the reference with the "gdn" row (the conv
inputs exactly), and 99% of the outputs must be the reference's bits: the emulation runs the
reference's fp32 operations without FMA, only some sums in another order.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from gdn_cases import (
    CASES, START_POSITIONS, case_id, check_steps, copy_layer, gdn_layer, live_rows, row_slots, step_inputs,
)
from host_build import build_host_library
from metrale_cli.errors import MetraleError
from metrale_cli.kernels.cuda_ops import CudaOps
from metrale_cli.kernels.loader import pointer_dtypes
from metrale_cli.kernels.registry import GDN_HEAD_K_DIMS, KERNELS_DIR
from metrale_cli.kernels import cuda_gdn
from metrale_cli.kernels.table import (
    GDN_DECODE, GDN_DECODE_ONE, GDN_MAX_DV, GDN_ONE_MAX_TAPS, GDN_ONE_THREADS, GDN_SPLIT, gdn_threads,
)

EQUAL_SHARE = 0.99
_LIB: list[ctypes.CDLL] = []


class EmulatingLoader:
    """Stands in for the CuPy loader: checks each argument against the signature as it does, then
    runs the launch on the emulated kernel."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.launched: list = []  # the entries launched, in order

    def launch(self, spec, sig, grid, block, *args, shared_mem=0, pdl=False):
        assert (spec, sig) in (GDN_DECODE, GDN_DECODE_ONE) and shared_mem == 0 and pdl
        typed = []
        for (name, kind), arg in zip(sig.params, args, strict=True):
            if kind.endswith("*"):
                assert arg.dtype == pointer_dtypes()[kind[:-1]] and arg.is_contiguous(), name
                typed.append(ctypes.c_void_p(arg.data_ptr()))
            else:
                assert isinstance(arg, int if kind == "i32" else float), name
                typed.append(arg)
        named = dict(zip((n for n, _ in sig.params), args))
        assert grid[0] == named["num_v_heads"] and len(grid) == 2 and len(block) == 1
        self.launched.append(spec)
        run = self.lib.host_gdn_decode_one if spec == GDN_DECODE_ONE[0] else self.lib.host_gdn_decode
        run(*typed, grid[1], block[0])


@pytest.fixture(scope="module")
def ops(tmp_path_factory) -> CudaOps:
    if not _LIB:
        handle = build_host_library("gdn_host.cpp", tmp_path_factory.mktemp("gdn"))
        for run in (handle.host_gdn_decode, handle.host_gdn_decode_one):
            run.argtypes = [ctypes.c_void_p] * 13 + [ctypes.c_int] * 9 + [ctypes.c_float] + [ctypes.c_int] * 2
        _LIB.append(handle)
    return CudaOps(EmulatingLoader(_LIB[0]))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_steps_equal_the_reference(ops, case):
    check_steps(ops.gdn_decode, case, EQUAL_SHARE, steps=4)


# Batch 1's cases the one-row entry serves, and one it leaves to the general entry (a block of
# 32 threads for 128 q / k channels).
ONE_ROW_CASES = [c for c in CASES if c[0] == 1] + [(1, 1, 2, 64, 8, 4), (1, 2, 1, 32, 16, 2)]


@pytest.mark.parametrize("case", ONE_ROW_CASES, ids=case_id)
def test_the_one_row_entry_equals_the_general_one_bit_for_bit(ops, case, monkeypatch):
    """Three steps of one row through each entry from the same pools: the same output bits and the
    same pools (window and state) after every step; the one-row entry is launched where it serves
    the shape."""
    rows, _, _, dk, dv, taps = case
    serves = 2 * dk <= gdn_threads(dv) <= GDN_ONE_THREADS and taps <= GDN_ONE_MAX_TAPS
    one, general = gdn_layer(case), None
    general = copy_layer(one)
    scratch = one.conv_pool.shape[0] - 1
    slots = row_slots(rows, scratch)
    for step in range(3):
        positions = torch.tensor([START_POSITIONS[1] + step], dtype=torch.int32)
        inputs = step_inputs(one, rows, 10 + step, True)
        ops.loader.launched.clear()
        got = ops.gdn_decode(*inputs, one, slots, positions)
        assert ops.loader.launched == [GDN_DECODE_ONE[0] if serves else GDN_DECODE[0]]
        monkeypatch.setattr(cuda_gdn, "GDN_ONE", False)
        want = ops.gdn_decode(*inputs, general, slots, positions)
        monkeypatch.setattr(cuda_gdn, "GDN_ONE", True)
        assert ops.loader.launched[-1] == GDN_DECODE[0]
        assert torch.equal(got, want)
        assert torch.equal(one.conv_pool, general.conv_pool) and torch.equal(one.recurrent_pool, general.recurrent_pool)
    assert live_rows(rows).all()


def test_inputs_of_their_own_equal_views_of_one_projection(ops):
    check_steps(ops.gdn_decode, CASES[2], EQUAL_SHARE, steps=2, fused=False)


def test_unserved_shapes_are_refused_with_a_hint(ops):
    case = (1, 1, 1, 24, 16, 4)  # Dk 24: no instantiation
    layer = gdn_layer(case)
    slots, positions = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(MetraleError, match="key head dims"):
        ops.gdn_decode(*step_inputs(layer, 1, 0, True), layer, slots, positions)
    layer = gdn_layer(CASES[0])
    fp32 = [t.float() for t in step_inputs(layer, 1, 0, True)]
    with pytest.raises(MetraleError, match="bf16") as e:
        ops.gdn_decode(*fp32, layer, slots, positions)
    assert e.value.hint


def test_the_host_mirrors_equal_the_kernel_source():
    text = (KERNELS_DIR / "gdn.cu").read_text()
    assert re.findall(r"case (\d+): gdn_head<(\d+), one>", text) == [(str(d), str(d)) for d in GDN_HEAD_K_DIMS]
    assert re.findall(r"^METRALE_GDN_ENTRY\((\w+), (\w+), (\w+)\)$", text, flags=re.M) == [
        ("gdn_decode_bf16", "GDN_MAX_THREADS", "false"), ("gdn_decode_one_bf16", "GDN_ONE_THREADS", "true")]
    assert re.search(r"#define GDN_MAX_DV (\d+)", text)[1] == str(GDN_MAX_DV)
    assert re.search(r"#define GDN_SPLIT (\d+)", text)[1] == str(GDN_SPLIT)
    assert re.search(r"#define GDN_MAX_THREADS (\d+)", text)[1] == str(gdn_threads(GDN_MAX_DV)) == "1024"
    assert re.search(r"#define GDN_ONE_THREADS (\d+)", text)[1] == str(GDN_ONE_THREADS)
    assert re.search(r"#define GDN_ONE_MAX_TAPS (\d+)", text)[1] == str(GDN_ONE_MAX_TAPS)
