"""Compile kernel modules to an sm_90 cubin on the CPU and read back the names they export.

This is the check that runs where no GPU is present (every developer machine and CI): NVRTC
through ``cuda.bindings.nvrtc`` (the ``cuda-bindings`` + ``nvidia-cuda-nvrtc`` wheels), else
``nvcc -cubin``. Exported names come from the cubin's ELF symbol table (global FUNC symbols).
Results are cached under ``$METRALE_CACHE_DIR/kernels`` (default ``~/.cache/metrale``), keyed by
a hash of the source, every header it includes, the defines, the arch and the compiler, so a
warm check costs a file read.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from metrale_cli.environment import cache_dir
from metrale_cli.kernels.registry import ARCH, INCLUDE_DIR, KernelModule

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class CompileResult:
    """Outcome of compiling one module: exported ``symbols`` when ``ok``, else the ``log``."""

    module: str
    ok: bool
    symbols: tuple[str, ...]
    log: str
    compiler: str
    seconds: float  # compile time of this call; 0 when served from the cache
    cached: bool


def kernel_cache_dir() -> Path:
    """Where compile checks and numeric verdicts are kept: ``kernels/`` under the cache folder."""
    return cache_dir() / "kernels"


def included_sources(path: Path, seen: dict[Path, str] | None = None) -> dict[Path, str]:
    """``path`` and every quoted header it includes, transitively: {path: text}."""
    seen = {} if seen is None else seen
    if path in seen:
        return seen
    seen[path] = path.read_text()
    for name in _INCLUDE.findall(seen[path]):
        for folder in (path.parent, INCLUDE_DIR):
            if (folder / name).is_file():
                included_sources((folder / name).resolve(), seen)
                break
    return seen


def source_digest(module: KernelModule, arch: str = ARCH) -> str:
    """Hash of everything that changes the module's binary except the compiler."""
    h = hashlib.sha256()
    for path, text in sorted(included_sources(module.path.resolve()).items()):
        h.update(path.name.encode() + b"\0" + text.encode() + b"\0")
    h.update(repr((module.defines, module.flags, arch)).encode())
    return h.hexdigest()[:24]


def function_symbols(elf: bytes) -> tuple[str, ...]:
    """Names of the global FUNC symbols of an ELF64 little-endian image (a cubin's kernels)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not an ELF64 image")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _name, kind, _fl, _addr, offset, size, link, _info, _al, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strtab = sections[link][4]
        for pos in range(offset, offset + size, entsize or 24):
            st_name, st_info = struct.unpack_from("<IB", elf, pos)
            if st_info >> 4 == 1 and st_info & 0xF == 2:  # STB_GLOBAL, STT_FUNC
                end = elf.index(b"\0", strtab + st_name)
                names.append(elf[strtab + st_name : end].decode())
    return tuple(sorted(names))


def _wheel_include_dirs() -> list[str]:
    """CUDA headers shipped by the nvidia-cuda-runtime wheel, for sources that include them."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    found = [p for r in roots for p in Path(r).glob("cu*/include") if (p / "cuda_bf16.h").is_file()]
    return [str(p) for p in found]


@functools.lru_cache(maxsize=None)
def compiler_id() -> str | None:
    """``nvrtc-13.5`` or ``nvcc-<version>``; None when neither is usable."""
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"nvrtc-{major}.{minor}"
    except Exception:  # noqa: BLE001 - no usable NVRTC: try nvcc
        pass
    nvcc = shutil.which("nvcc")
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        return "nvcc-" + out.strip().splitlines()[-1].split()[-1] if out.strip() else "nvcc"
    return None


def _nvrtc_cubin(module: KernelModule, arch: str) -> tuple[bytes | None, str]:
    from cuda.bindings import nvrtc

    _, prog = nvrtc.nvrtcCreateProgram(module.path.read_bytes(), module.source.encode(), 0, [], [])
    opts = [f"--gpu-architecture={arch}", *module.options()]
    opts += [f"-I{d}" for d in _wheel_include_dirs()]
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)  # a fresh buffer: NVRTC writes into it (b" " * 1 is CPython's shared b" ")
        nvrtc.nvrtcGetProgramLog(prog, log)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return None, log.decode(errors="replace").rstrip("\0 \n")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = bytearray(size)
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return bytes(cubin), log.decode(errors="replace").rstrip("\0 \n")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvcc_cubin(module: KernelModule, arch: str) -> tuple[bytes | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "module.cubin"
        cmd = ["nvcc", "-cubin", f"-arch={arch}", *module.options(), "-o", str(out), str(module.path)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = (proc.stdout + proc.stderr).strip()
        return (out.read_bytes() if proc.returncode == 0 else None), log


def compile_cubin(module: KernelModule, arch: str = ARCH, compiler: str | None = None):
    """-> (cubin or None, log). ``compiler``: "nvrtc", "nvcc" or None for the first available."""
    kind = compiler or (compiler_id() or "none").split("-")[0]
    if kind == "nvrtc":
        return _nvrtc_cubin(module, arch)
    if kind == "nvcc" and shutil.which("nvcc"):
        return _nvcc_cubin(module, arch)
    return None, "no CUDA compiler: install cuda-bindings and nvidia-cuda-nvrtc, or put nvcc on PATH"


def check_module(module: KernelModule, arch: str = ARCH, compiler: str | None = None) -> CompileResult:
    """Compile ``module`` for ``arch`` (or read the cached outcome) and list its kernels."""
    ident = compiler_id() if compiler is None else compiler
    if ident is None:
        _, log = compile_cubin(module, arch)
        return CompileResult(module.name, False, (), log, "none", 0.0, False)
    entry = kernel_cache_dir() / f"{module.name}-{source_digest(module, arch)}-{ident}.json"
    if entry.is_file():
        data = json.loads(entry.read_text())
        return CompileResult(module.name, data["ok"], tuple(data["symbols"]), data["log"], ident, 0.0, True)
    start = time.perf_counter()
    cubin, log = compile_cubin(module, arch, ident.split("-")[0])
    seconds = time.perf_counter() - start
    symbols = function_symbols(cubin) if cubin is not None else ()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"ok": cubin is not None, "symbols": symbols, "log": log}))
        tmp.replace(entry)
    except OSError:  # an unwritable cache (METRALE_CACHE_DIR): the next check compiles again
        pass
    return CompileResult(module.name, cubin is not None, symbols, log, ident, seconds, False)


def check_modules(modules, arch: str = ARCH, workers: int | None = None) -> dict[str, CompileResult]:
    """:func:`check_module` for many modules, the cold ones compiled in parallel processes
    (NVRTC serialises compiles inside one process; the forked workers only run NVRTC and write
    the disk cache). {module name: result}."""
    modules = list(modules)
    ident = compiler_id()
    cold = [m for m in modules
            if ident and not (kernel_cache_dir() / f"{m.name}-{source_digest(m, arch)}-{ident}.json").is_file()]
    workers = min(len(cold), workers or os.cpu_count() or 1)
    compiled = {}
    if workers > 1:
        import multiprocessing

        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            # the workers' own results: their compile times and "not cached", not the parent's re-read
            compiled = {r.module: r for r in pool.map(check_module, cold, [arch] * len(cold))}
    return {m.name: compiled.get(m.name) or check_module(m, arch) for m in modules}
