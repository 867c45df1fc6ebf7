"""The documented environment levers: the only configuration read from the environment."""

from __future__ import annotations

import os
import pathlib

ENV_LEVERS: dict[str, str] = {
    "METRALE_CACHE_DIR": "where converted GGUF weights and kernel compile checks are cached "
    "(default ~/.cache/metrale)",
    "HF_HUB_OFFLINE": "1 = never contact the hub; hub ids must already be in the HF cache",
    "HF_HOME": "the Hugging Face cache folder for hub ids",
}


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("METRALE_CACHE_DIR", "~/.cache/metrale")).expanduser()


def levers_help() -> str:
    return "Environment: " + "; ".join(f"{k}: {v}" for k, v in ENV_LEVERS.items())
