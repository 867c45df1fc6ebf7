"""Build a kernels_cu/host/ library (kernel code emulated on the CPU) for the host-emulation tests."""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess

import pytest

from metrale_cli.kernels.registry import KERNELS_DIR, MODULES, tc_module


def build_host_library(source: str, out_dir: pathlib.Path, defines: dict[str, str] | None = None,
                       name: str | None = None) -> ctypes.CDLL:
    """Compile ``kernels_cu/host/<source>`` with ``-D`` ``defines`` into ``out_dir`` and load it;
    skips the test where no g++ (with C++20) or no host sources are present."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not on PATH")
    src = KERNELS_DIR / "host" / source
    if not src.is_file():
        pytest.skip("kernels_cu/host/ is in the source checkout only")
    lib = out_dir / f"{name or src.stem}.so"
    # -fno-gnu-unique: each library keeps its own inline variables and static locals, so that two
    # loaded side by side (the decode's modules) do not share emulate.h's state or __shared__ memory
    cmd = ["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-fno-gnu-unique", "-shared", "-fPIC",
           f"-I{KERNELS_DIR / 'include'}",
           *(f"-D{k}={v}" for k, v in (defines or {}).items()), str(src), "-o", str(lib), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode and "c++20" in proc.stderr:
        pytest.skip("this g++ has no C++20")
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(lib))


def build_tc_decode_library(out_dir: pathlib.Path, head_dim: int, extra: dict[str, str] | None = None) -> ctypes.CDLL:
    """paged_decode_tc.cu's host library as the tensor-core decode module of ``head_dim`` builds it
    (its defines: paged_decode_tc at 64 / 128, paged_decode_tc_wide at 256), with ``extra`` defines."""
    module = tc_module(head_dim)
    name = module + "".join(f"_{k}_{v}" for k, v in (extra or {}).items())
    return build_host_library("paged_decode_tc_host.cpp", out_dir, dict(MODULES[module].defines) | (extra or {}),
                              name=name)
