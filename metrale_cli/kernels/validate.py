"""The library behind ``metrale validate-kernels``: is every kernel a dtype needs here and right?

Without a GPU each kernel is compiled to an sm_90 cubin (compile.py) and its symbol looked up;
the numeric column says "skipped (no GPU)". On a GPU each kernel it runs (below sm_90 not the
sm_90-only projections, table.SM90_KERNELS) is loaded through CuPy and checked against its torch
reference (``checks.py``). A passed check is recorded in the kernel
cache, keyed by the kernel, head_dim, the module's source digest (its cubin's inputs), the GPU,
the driver and the checks' own sources: a later run on the same GPU loads the kernels and reuses
those verdicts without importing torch (``recheck`` runs every check again). Nothing is printed
here: the CLI renders the :class:`ValidationReport`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.compile import check_modules, kernel_cache_dir, source_digest
from metrale_cli.kernels.kv_kernels import kernels_to_validate, kv_kernels
from metrale_cli.kernels.registry import KernelSpec, module_for
from metrale_cli.kernels.table import for_arch
from metrale_cli.kv.dtypes import HEAD_DIMS, concrete

SKIPPED = "skipped (no GPU)"
MATCHES = "matches reference"
CACHED = "matches reference (cached)"


@dataclass(frozen=True)
class KernelRow:
    kernel: str
    compiled: str
    symbol: str
    numeric: str
    ok: bool


@dataclass(frozen=True)
class ValidationReport:
    dtype: str
    head_dim: int
    on_gpu: bool
    rows: tuple[KernelRow, ...]
    total_seconds: float
    cold_compile_seconds: float

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)


Progress = Callable[[str, int, int], None]  # (kernel, index, total)


def check_head_dim(head_dim: int) -> int:
    """``--head-dim`` must be one the attention kernels are built for."""
    if head_dim not in HEAD_DIMS:
        raise MetraleError(f"the attention kernels are built for head_dim {', '.join(map(str, HEAD_DIMS))}, "
                           f"not {head_dim}",
                           hint="pass the head_dim of the model's attention, e.g. --head-dim 128")
    return head_dim


def gpu_count() -> int:
    """CUDA devices CuPy sees; 0 without CuPy or a driver (no torch import)."""
    try:
        import cupy
    except ImportError:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no driver / no device: a CPU machine
        return 0


def validate_kernels(dtype, head_dim: int = 128, progress: Progress | None = None,
                     on_gpu: bool | None = None, recheck: bool = False) -> ValidationReport:
    """Check every kernel ``dtype`` needs at ``head_dim``; numerically too when on a GPU (verdicts
    recorded for this GPU are reused unless ``recheck``). ``progress(kernel, i, n)``: first with
    i = -1 (the modules compile), then once a kernel, i = 0 .. n-1."""
    gpu = gpu_count() > 0 if on_gpu is None else on_gpu
    d = concrete(dtype)
    specs = kernels_to_validate(d, check_head_dim(head_dim))
    if gpu:  # what this GPU runs: the sm_90-only kernels are not used on an older one
        from metrale_cli.kernels.loader import current_device, device_arch

        specs = for_arch(specs, device_arch(current_device()))
    unserved = kv_kernels(d, head_dim).unserved()
    start, cold = time.perf_counter(), 0.0
    rows = []
    if progress:  # the total from the start: the CPU checker compiles every module before the first row
        progress("compiling", -1, len(specs))
    checker = _GpuChecker(head_dim, recheck, unserved) if gpu else _CpuChecker(specs, unserved)
    for i, spec in enumerate(specs):
        if progress:
            progress(str(spec), i, len(specs))
        row, seconds = checker.row(spec)
        rows.append(row)
        cold += seconds
    if gpu:
        cold = sum(e.seconds for e in checker.loader.events if e.cold)
    else:  # the modules' compiles ran side by side: their wall time, not the sum of each one's
        cold = checker.compile_seconds
    return ValidationReport(d.value, head_dim, gpu, tuple(rows), time.perf_counter() - start, cold)


def _missing(spec: KernelSpec) -> KernelRow:
    return KernelRow(str(spec), "missing (not in this build)", "-", "-", False)


class _CpuChecker:
    """Compiles the modules of every kernel (the cold ones in parallel) and reads their symbols."""

    def __init__(self, specs: list[KernelSpec], unserved: dict[str, str]):
        modules = {m.name: m for m in (module_for(s) for s in specs) if m is not None}
        start = time.perf_counter()
        self.results, self.unserved = check_modules(modules.values()), unserved
        cold = any(not r.cached for r in self.results.values())
        self.compile_seconds = time.perf_counter() - start if cold else 0.0

    def row(self, spec: KernelSpec) -> tuple[KernelRow, float]:
        module = module_for(spec)
        if module is None:
            return _missing(spec), 0.0
        result = self.results[module.name]
        if not result.ok:
            last = (result.log.splitlines() or ["?"])[-1]
            return KernelRow(str(spec), f"failed: {last}", "-", "-", False), result.seconds
        how = "cached" if result.cached else f"{result.seconds:.2f} s"
        exported = spec.function in result.symbols
        symbol = "exported" if exported else "not exported"
        problem = self.unserved.get(str(spec))
        numeric = SKIPPED if problem is None else problem
        row = KernelRow(str(spec), f"yes ({result.compiler}, {how})", symbol, numeric, exported and not problem)
        return row, result.seconds


class _GpuChecker:
    """Loads each kernel through CuPy on the current device and checks it numerically, or reuses
    the verdict this GPU recorded for the same sources."""

    def __init__(self, head_dim: int, recheck: bool, unserved: dict[str, str], loader=None,
                 verdicts: VerdictStore | None = None, device: int | None = None):
        from metrale_cli.kernels.loader import KernelLoader, current_device

        self.loader = loader or KernelLoader()
        self.device = current_device() if device is None else device
        self.head_dim, self.recheck, self.unserved = head_dim, recheck, unserved
        self.verdicts = verdicts or VerdictStore.for_device(self.device)
        self._ops = None
        self._digests: dict[str, str] = {}

    def row(self, spec: KernelSpec) -> tuple[KernelRow, float]:
        module = module_for(spec)
        if module is None:
            return _missing(spec), 0.0
        try:
            self.loader.function(spec, self.device)
        except Exception as exc:  # noqa: BLE001 - reported in the table, not raised
            return KernelRow(str(spec), f"failed: {exc}".splitlines()[0], "-", "-", False), 0.0
        problem = self.unserved.get(str(spec))
        numeric = problem
        if problem is None:
            if module.name not in self._digests:  # a module serves several rows: hash it once
                self._digests[module.name] = source_digest(module, self.verdicts.arch)
            key = self.verdicts.key(spec, self.head_dim, self._digests[module.name])
            if not self.recheck and self.verdicts.passed(key):
                numeric = CACHED
            else:
                problem = self._check(spec)
                numeric = MATCHES if problem is None else problem
                if problem is None:
                    self.verdicts.record(key)
        return KernelRow(str(spec), "yes (CuPy)", "exported", numeric, problem is None), 0.0

    def _check(self, spec: KernelSpec) -> str | None:
        from metrale_cli.kernels.checks import NUMERIC_CHECKS

        if self._ops is None:
            from metrale_cli.kernels.cuda_ops import CudaOps

            self._ops = CudaOps(self.loader)
        check = NUMERIC_CHECKS.get(str(spec))
        try:
            return check(self._ops, self.head_dim) if check else "no numeric check"
        except MetraleError as exc:  # e.g. a sibling kernel of the dtype does not serve head_dim
            return exc.message


_CHECK_SOURCES = ("kernels/checks.py", "kernels/cases.py", "kernels/reference.py", "kernels/cuda_ops.py",
                  "kernels/cuda_attention.py", "kernels/kv_kernels.py", "kernels/table.py", "kernels/tolerances.py",
                  "kernels/sdpa_prefill.py", "kv/dtypes.py", "kv/formats.py", "kv/pool.py", "kv/quant.py", "kv/wht.py")


@functools.lru_cache(maxsize=None)
def _checks_digest() -> str:
    """Digest of the sources a numeric verdict depends on besides the kernel's own."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for name in _CHECK_SOURCES:
        path = package / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"-"))
    return digest.hexdigest()


class VerdictStore:
    """Passed numeric checks of one GPU, a file each under the kernel cache's ``verified/``."""

    def __init__(self, folder: Path, gpu: str, arch: str):
        self.folder, self.gpu, self.arch = folder, gpu, arch
        self.checks_digest = _checks_digest()

    @classmethod
    def for_device(cls, device: int) -> VerdictStore:
        from metrale_cli.kernels.loader import device_arch, device_identity

        return cls(kernel_cache_dir() / "verified", device_identity(device), device_arch(device))

    def key(self, spec: KernelSpec, head_dim: int, module_digest: str) -> str:
        text = "\n".join((str(spec), str(head_dim), module_digest, self.gpu, self.arch, self.checks_digest))
        return hashlib.sha256(text.encode()).hexdigest()

    def passed(self, key: str) -> bool:
        return (self.folder / f"{key}.json").is_file()

    def record(self, key: str) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{key}.{os.getpid()}"
            tmp.write_text(json.dumps({"gpu": self.gpu, "arch": self.arch, "passed": time.time()}))
            tmp.replace(self.folder / f"{key}.json")
        except OSError:  # an unwritable cache: the check simply runs again next time
            pass
