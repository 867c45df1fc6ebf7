"""Shared pytest setup: the ``gpu`` marker, skipped with a reason where CUDA is unavailable, and the
one ``ops`` fixture of the GPU tests (the cuda backend)."""

import importlib.util
import os

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU with CUDA and CuPy (make test-gpu)")
    # Under pytest-xdist each worker would take every core for its CPU references, N workers
    # oversubscribing the machine N times over; each takes its share instead.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ops():
    """The cuda backend (``CudaOps``) the GPU tests launch through; one per test session."""
    from metrale_cli.kernels.cuda_ops import CudaOps

    return CudaOps()
