"""Load kernel modules with CuPy and launch them on torch's current stream.

Modules compile through CuPy's ``RawModule`` (NVRTC, CuPy's on-disk cache), once per
(module, defines, arch, device); every first load is logged on the ``metrale.kernels`` logger
with its time, and called *cold* when it wrote a new entry to CuPy's cache. :meth:`launch` is the
one place a kernel is called: it checks every argument against the kernel's :class:`Signature`
(dtype, device, contiguity, 16-byte alignment) and types every scalar, so tensors travel as raw
pointers (float8 included) and ints/floats as np.int32/np.float32. CuPy is imported lazily: it
does not exist on CPU-only machines.

``launch(..., pdl=True)`` launches with programmatic stream serialization (sm_90+, through
cuda-bindings' ``cuLaunchKernelEx``): the kernel may start while the one before it finishes and
must call ``pdl_wait()`` (kernels_cu/include/pdl.cuh) first. Without cuda-bindings or below sm_90
the launch is an ordinary one, and the kernels' waits are no-ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from pathlib import Path

import numpy as np

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.compile import source_digest
from metrale_cli.kernels.registry import KernelModule, KernelSpec, module_for
from metrale_cli.kernels.table import Signature

if TYPE_CHECKING:
    import torch

log = logging.getLogger("metrale.kernels")

SCALARS = {"i32": np.int32, "f32": np.float32}


@dataclass(frozen=True)
class LoadEvent:
    module: str
    seconds: float
    cold: bool


class _TorchStream:
    """A torch stream handle in the CUDA stream protocol that ``Stream.from_external`` takes."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _cupy():
    try:
        import cupy
    except ImportError:
        raise MetraleError(
            "the cuda backend needs CuPy, which is not installed",
            hint="pip install cupy-cuda13x, or use --backend torch",
        ) from None
    return cupy


def _cupy_cache_stamp() -> int:
    """Modification time of CuPy's (flat) kernel cache folder: a compile that adds an entry
    changes it. A stat, not a walk: the folder holds an entry per module variant ever built."""
    folder = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    try:
        return folder.stat().st_mtime_ns
    except OSError:
        return 0


@functools.lru_cache(maxsize=None)
def pointer_dtypes() -> dict:
    """The torch dtype of each pointer type (torch is imported on the first launch, not before)."""
    import torch

    return {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "f32": torch.float32, "i32": torch.int32,
            "i64": torch.int64, "u8": torch.uint8}


def current_device() -> int:
    """The current CUDA device's index, as CuPy sees it."""
    return int(_cupy().cuda.runtime.getDevice())


def device_index(device) -> int:
    """A device index from an int or a ``torch.device`` (``cuda`` without index: the current one)."""
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else current_device()


@functools.lru_cache(maxsize=None)
def device_arch(index: int) -> str:
    return f"sm_{_cupy().cuda.Device(index).compute_capability}"


@functools.lru_cache(maxsize=None)
def device_identity(index: int) -> str:
    """The GPU's name, compute capability and driver version: what a numeric verdict holds for."""
    cp = _cupy()
    name = cp.cuda.runtime.getDeviceProperties(index)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return f"{name} {device_arch(index)} driver {cp.cuda.runtime.driverGetVersion()}"


@functools.lru_cache(maxsize=None)
def _pdl_driver():
    """cuda-bindings' driver module, or None where it is not installed (ordinary launches)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        log.info("cuda-bindings is not installed: kernels launch without programmatic dependent launch")
        return None
    return driver


def clusters_available(index: int) -> bool:
    """Whether launches on GPU ``index`` may run in thread block clusters (sm_90 and cuda-bindings)."""
    return int(device_arch(index)[3:]) >= 90 and _pdl_driver() is not None


_CTYPES = {np.int32: ctypes.c_int32, np.float32: ctypes.c_float, np.uint64: ctypes.c_uint64}


PORTABLE_CLUSTER = 8  # the largest cluster every sm_90 GPU schedules; larger ones are opted into
_NON_PORTABLE: set[int] = set()  # the functions opted into larger clusters (once each)


def _launch_ex(driver, fn, grid, block, shared_mem: int, stream_ptr: int, typed: list, programmatic: bool = True,
               cluster: tuple = (1, 1, 1)) -> None:
    """``fn`` (a CuPy function) through cuLaunchKernelEx: with the programmatic-stream-serialization
    attribute, and in clusters of ``cluster`` (x, y, z) CTAs when that is more than one."""
    grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_mem
    config.hStream = driver.CUstream(stream_ptr)
    attrs = []
    if programmatic:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    size = cluster[0] * cluster[1] * cluster[2]
    if size > 1:
        if size > PORTABLE_CLUSTER and fn.kernel.ptr not in _NON_PORTABLE:
            (err,) = driver.cuFuncSetAttribute(
                driver.CUfunction(fn.kernel.ptr),
                driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise MetraleError(f"clusters of {size} CTAs are not allowed: {err.name}")
            _NON_PORTABLE.add(fn.kernel.ptr)
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
        attrs.append(attr)
    config.attrs = attrs
    config.numAttrs = len(attrs)
    # A tensor map (driver.CUtensorMap) goes by value: the parameter's address is its own.
    values = [v if hasattr(v, "getPtr") else _CTYPES[type(v)](v) for v in typed]
    params = (ctypes.c_void_p * len(values))(*(v.getPtr() if hasattr(v, "getPtr") else ctypes.addressof(v)
                                                for v in values))
    (err,) = driver.cuLaunchKernelEx(config, driver.CUfunction(fn.kernel.ptr), ctypes.addressof(params), 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise MetraleError(f"kernel launch failed: {err.name}")


@dataclass
class KernelLoader:
    """Compiled modules and typed launches for one process; not thread-safe. ``extra``: modules
    outside the registry (a tool's own kernels), by name. ``carveout``: every function loaded asks
    for this shared-memory carveout (percent of the most an SM has; the layer tools' A/B of it),
    None: the driver's choice per kernel."""

    extra: dict[str, KernelModule] = field(default_factory=dict)
    carveout: int | None = None
    events: list[LoadEvent] = field(default_factory=list)
    _modules: dict = field(default_factory=dict)
    _functions: dict = field(default_factory=dict)
    _streams: dict = field(default_factory=dict)
    _dynamic_limits: dict = field(default_factory=dict)

    def function(self, spec: KernelSpec, device):
        """The CuPy function for ``spec`` on ``device`` (an index or a ``torch.device``),
        compiling its module on first use."""
        index = device_index(device)
        key = (spec, index)
        if key not in self._functions:
            fn = self._module(spec, index).get_function(spec.function)
            if self.carveout is not None:
                fn.preferred_shared_memory_carveout = self.carveout
            self._functions[key] = fn
        return self._functions[key]

    def _module(self, spec: KernelSpec, index: int):
        module = self.extra.get(spec.module) or module_for(spec)
        if module is None or spec.function not in module.functions:
            raise MetraleError(f"kernel {spec} is not in this build")
        arch = device_arch(index)
        key = (module.name, module.defines, arch, index)
        if key in self._modules:
            return self._modules[key]
        cp = _cupy()
        # CuPy's cache key covers the source text and options, not included headers: the
        # digest define makes a header edit a new cache entry.
        options = module.options() + (f"-DMETRALE_SOURCE_DIGEST=0x{source_digest(module, arch)[:15]}",)
        before, start = _cupy_cache_stamp(), time.perf_counter()
        with cp.cuda.Device(index):
            raw = cp.RawModule(code=module.path.read_text(), options=options, backend="nvrtc")
            raw.compile()
        seconds = time.perf_counter() - start
        cold = _cupy_cache_stamp() != before
        self.events.append(LoadEvent(module.name, seconds, cold))
        log.info("%s kernel module %s (%s) in %.2f s", "compiled" if cold else "loaded cached",
                 module.name, arch, seconds)
        self._modules[key] = raw
        return raw

    def _stream(self, cp, device: torch.device):
        import torch

        ptr = torch.cuda.current_stream(device).cuda_stream
        if ptr not in self._streams:
            if hasattr(cp.cuda.Stream, "from_external"):
                self._streams[ptr] = cp.cuda.Stream.from_external(_TorchStream(ptr))
            else:  # CuPy < 14
                self._streams[ptr] = cp.cuda.ExternalStream(ptr, device.index)
        return self._streams[ptr]

    def launch(self, spec: KernelSpec, sig: Signature, grid, block, *args, shared_mem: int = 0,
               pdl: bool = False, cluster: tuple = (1, 1, 1)):
        """Check ``args`` against ``sig`` and launch ``spec`` on torch's current stream
        (``pdl``: programmatically, where the GPU and cuda-bindings allow; ``cluster``: in clusters
        of (x, y, z) CTAs, which needs :func:`clusters_available` when more than one)."""
        device = _device_of(spec, args)
        params = zip(sig.params, args, strict=True)
        typed = [_typed(spec, name, kind, arg, device) for (name, kind), arg in params]
        cp = _cupy()
        fn = self.function(spec, device)
        if shared_mem:
            self._allow_dynamic_shared(fn, shared_mem)
        stream = self._stream(cp, device)
        with cp.cuda.Device(device.index), stream:
            clustered = cluster != (1, 1, 1)
            driver = _pdl_driver() if (pdl or clustered) and int(device_arch(device.index)[3:]) >= 90 else None
            if clustered and driver is None:
                raise MetraleError(f"{spec}: a cluster launch needs an sm_90 GPU and cuda-bindings")
            if driver is None and any(kind == "tmap" for _, kind in sig.params):
                raise MetraleError(f"{spec}: a tensor-map kernel needs an sm_90 GPU and cuda-bindings")
            if driver is not None:
                _launch_ex(driver, fn, grid, block, shared_mem, stream.ptr, typed, pdl, tuple(cluster))
            else:
                fn(tuple(grid), tuple(block), tuple(typed), shared_mem=shared_mem)

    def _allow_dynamic_shared(self, fn, shared_mem: int):
        """Opt ``fn`` into ``shared_mem`` bytes of dynamic shared memory where its limit is lower.
        The default limit is 48 KB less the kernel's static shared memory, so a kernel with both
        needs the opt-in below 48 KB of dynamic memory too."""
        limit = self._dynamic_limits.get(fn.kernel.ptr)
        if limit is None:
            limit = self._dynamic_limits[fn.kernel.ptr] = fn.max_dynamic_shared_size_bytes
        if shared_mem > limit:
            fn.max_dynamic_shared_size_bytes = shared_mem
            self._dynamic_limits[fn.kernel.ptr] = shared_mem


def _device_of(spec: KernelSpec, args) -> torch.device:
    import torch

    for arg in args:
        if isinstance(arg, torch.Tensor):
            if arg.device.type != "cuda":
                raise MetraleError(f"{spec}: tensors must be on a CUDA device (got {arg.device})")
            return arg.device
    raise MetraleError(f"{spec}: no tensor argument")


def _typed(spec: KernelSpec, name: str, kind: str, arg, device: torch.device):
    import torch

    if kind == "tmap":
        driver = _pdl_driver()
        if driver is None or not isinstance(arg, driver.CUtensorMap):
            raise MetraleError(f"{spec}: {name} must be a tensor map (got {type(arg).__name__})")
        return arg
    if kind in SCALARS:
        if isinstance(arg, torch.Tensor):
            raise MetraleError(f"{spec}: {name} must be a Python {kind} scalar, not a tensor")
        if kind == "i32" and not -(2**31) <= int(arg) < 2**31:
            raise MetraleError(f"{spec}: {name}={arg} does not fit in int32")
        return SCALARS[kind](arg)
    optional = kind.endswith("?")
    want = pointer_dtypes()[kind.rstrip("?").rstrip("*")]
    if arg is None and optional:
        return np.uint64(0)
    if not isinstance(arg, torch.Tensor) or arg.dtype != want:
        got = arg.dtype if isinstance(arg, torch.Tensor) else type(arg).__name__
        raise MetraleError(f"{spec}: {name} must be a {want} tensor (got {got})")
    if arg.device != device:
        raise MetraleError(f"{spec}: {name} is on {arg.device}, other arguments on {device}")
    if not arg.is_contiguous():
        raise MetraleError(f"{spec}: {name} must be contiguous")
    if arg.data_ptr() % 16:
        raise MetraleError(f"{spec}: {name} must be 16-byte aligned (a fresh or .clone()d tensor is)")
    return np.uint64(arg.data_ptr())
