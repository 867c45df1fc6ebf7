"""The documented environment levers: the only configuration read from the environment."""

from __future__ import annotations

import functools
import math
import os
import pathlib

from metrale_cli.errors import MetraleError

VERSION = "0.1.0"  # the package's version (pyproject.toml's)

ENV_LEVERS: dict[str, str] = {
    "METRALE_CACHE_DIR": "where converted GGUF weights and kernel compile checks are cached "
    "(default ~/.cache/metrale)",
    "HF_HUB_OFFLINE": "1 = never contact the hub; hub ids must already be in the HF cache",
    "HF_HOME": "the Hugging Face cache folder for hub ids",
    "TURBO_INNERQ": "InnerQ calibration tokens for a rotated (turbo) K side, as "
    "--innerq-calibration-tokens (0 = off, the default)",
    "TURBO_INNERQ_STRENGTH": "InnerQ strength α in s = (mean/rms)^α (default 0.5)",
}


def cache_dir() -> pathlib.Path:
    """``$METRALE_CACHE_DIR``, else ``~/.cache/metrale``: converted GGUF weights, kernel checks."""
    return pathlib.Path(os.environ.get("METRALE_CACHE_DIR") or "~/.cache/metrale").expanduser()


def levers_help() -> str:
    return "Environment: " + "; ".join(f"{k}: {v}" for k, v in ENV_LEVERS.items())


def _number(name: str, kind: type, default):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise MetraleError(f"{name}={raw!r} is not {what}", hint=ENV_LEVERS[name]) from None
    if not math.isfinite(value):  # float("nan") and float("inf") parse; nan scales give empty output
        raise MetraleError(f"{name}={raw!r} is not a finite number", hint=ENV_LEVERS[name])
    if value < 0:
        raise MetraleError(f"{name}={raw!r} must not be negative", hint=ENV_LEVERS[name])
    return value


def innerq_env() -> tuple[int, float]:
    """(calibration tokens, strength) from TURBO_INNERQ / TURBO_INNERQ_STRENGTH."""
    return _number("TURBO_INNERQ", int, 0), _number("TURBO_INNERQ_STRENGTH", float, 0.5)


@functools.lru_cache(maxsize=1)
def build_info() -> dict:
    """{"version", "commit"}: the package's version and, in a git checkout, the commit it runs
    (with "+dirty" for uncommitted changes to tracked files); commit None elsewhere."""
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    commit = None
    if (root / ".git").exists():
        try:
            run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,  # noqa: E731
                                            timeout=10)
            head = run("rev-parse", "--short=12", "HEAD")
            if head.returncode == 0:
                dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
                commit = head.stdout.strip() + ("+dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"version": VERSION, "commit": commit}
