"""HF-style folders: config.json plus one ``model.safetensors`` or a sharded index.

File integrity (headers, sizes, index against shards) is checked up front, before any tensor
is read, so a broken download fails in one line instead of half-way through loading.
Checking names and shapes against the architecture is the model builder's job.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from metrale_cli.checkpoint.finite import check_finite
from metrale_cli.checkpoint.json_file import read_json_object
from metrale_cli.errors import MetraleError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024

Progress = Callable[[int, int], None]
Transform = Callable[[str, torch.Tensor], torch.Tensor]  # (name, tensor as read) -> the tensor kept


@dataclass(frozen=True)
class ShardHeader:
    """What one .safetensors file declares: tensor name -> (dtype, shape, byte length)."""

    path: pathlib.Path
    entries: dict[str, tuple[str, tuple[int, ...], int]]
    metadata: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(length for _, _, length in self.entries.values())


def read_hf_config(folder: pathlib.Path) -> dict:
    """config.json of an HF folder, as a dict; MetraleError when missing or not JSON."""
    if not folder.is_dir():
        raise MetraleError(f"model folder not found: {folder}", "pass a folder with config.json")
    path = folder / "config.json"
    if not path.is_file():
        raise MetraleError(f"{folder} has no config.json", "is this a Hugging Face model folder?")
    return read_json_object(path, "is this a Hugging Face model folder?")


def read_shard_header(path: pathlib.Path) -> ShardHeader:
    """Parse and check a safetensors header against the file's size (no tensor data read)."""
    try:
        return _read_header(path)
    except OSError as exc:  # a directory or a broken link in the file's place
        raise MetraleError(f"{path} is not a readable file ({exc.strerror})", "re-download the file") from None


def _read_header(path: pathlib.Path) -> ShardHeader:
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise MetraleError(f"{path} is truncated: no safetensors header", "re-download the file")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise MetraleError(f"{path} has a corrupt safetensors header (bad length {length})",
                               "re-download the file")
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MetraleError(f"{path} has a corrupt safetensors header (not JSON)",
                           "re-download the file") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise MetraleError(f"{path} has a corrupt safetensors header (JSON nested too deeply)",
                           "re-download the file") from None
    if not isinstance(header, dict):
        raise MetraleError(f"{path} has a corrupt safetensors header (not a JSON object)", "re-download the file")
    return _check_entries(path, header, data_size=size - 8 - length)


def _open(path: pathlib.Path):
    """The file through safetensors, whose own header checks (dtypes, each tensor's bytes against
    its shape, offsets covering the data) fail as one line."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as exc:
        raise MetraleError(f"{path} has a corrupt safetensors header ({exc})", "re-download the file") from None


def _check_entries(path: pathlib.Path, header: dict, data_size: int) -> ShardHeader:
    entries, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            entries[name] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]), stop - start)
        except (KeyError, TypeError, ValueError):
            raise MetraleError(f"{path} has a corrupt safetensors header (entry {name!r})",
                               "re-download the file") from None
        end = max(end, stop)
    if end > data_size:
        raise MetraleError(f"{path} is truncated: {data_size} data bytes, header needs {end}",
                           "re-download the file")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise MetraleError(f"{path} has a corrupt safetensors header (entry '__metadata__')", "re-download the file")
    return ShardHeader(path, entries, metadata)


def weight_headers(folder: pathlib.Path) -> list[ShardHeader]:
    """Headers of every weight file of an HF folder, checked against its index when sharded and
    against each other (no tensor in two files: which one to load would be a guess)."""
    if (folder / INDEX_FILE).is_file():
        return _once_each(_indexed_headers(folder))
    if _present(folder / SINGLE_FILE):
        return [read_shard_header(folder / SINGLE_FILE)]
    loose = sorted(folder.glob("model*.safetensors"))
    if loose:
        return _once_each([read_shard_header(p) for p in loose])
    raise MetraleError(f"{folder} has no weights ({SINGLE_FILE} or {INDEX_FILE})",
                       "only safetensors checkpoints are supported")


def _present(path: pathlib.Path) -> bool:
    """Whether ``path`` is there, even as a directory or a broken link: reading it then says
    what is wrong with it, rather than the file being called missing."""
    return os.path.lexists(path)


def _once_each(headers: list[ShardHeader]) -> list[ShardHeader]:
    seen: dict[str, pathlib.Path] = {}
    for header in headers:
        for name in header.entries:
            if name in seen:
                raise MetraleError(f"tensor {name} is in both {seen[name].name} and {header.path.name}",
                                   "re-download the checkpoint")
            seen[name] = header.path
    return headers


def _indexed_headers(folder: pathlib.Path) -> list[ShardHeader]:
    index_path = folder / INDEX_FILE
    weight_map = _weight_map(index_path)
    headers = {}
    for shard in sorted(set(weight_map.values())):
        if not _present(folder / shard):
            raise MetraleError(f"{index_path.name} names a missing shard: {shard}",
                               "re-download the checkpoint")
        headers[shard] = read_shard_header(folder / shard)
    missing = [n for n, shard in weight_map.items() if n not in headers[shard].entries]
    if missing:
        raise MetraleError(f"{len(missing)} tensor(s) in {index_path.name} are not in their shard, "
                           f"e.g. {missing[0]}", "re-download the checkpoint")
    return list(headers.values())


def _weight_map(index_path: pathlib.Path) -> dict[str, str]:
    """The index's tensor name -> shard file name map."""
    weight_map = read_json_object(index_path, "re-download the checkpoint").get("weight_map")
    if not isinstance(weight_map, dict):
        raise MetraleError(f"{index_path} is not a valid index (no weight_map object)", "re-download the checkpoint")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise MetraleError(f"{index_path.name} maps {name} to {shard!r}, not a shard file name",
                               "re-download the checkpoint")
    return weight_map


# The stored dtypes of the weights metrale runs: floats, each cast to the run's dtype as it is
# read. fp8 and integer weights are quantized data, which needs its scales and kernels.
WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")


def _check_dtypes(wanted: list[tuple[ShardHeader, list[str]]]) -> None:
    for header, names in wanted:
        for name in names:
            stored = header.entries[name][0]
            if stored not in WEIGHT_DTYPES:
                raise MetraleError(f"{header.path}: tensor {name} is stored as {stored}: fp8 and integer "
                                   f"(quantized) weights are not supported yet, only {', '.join(WEIGHT_DTYPES)}",
                                   "use a bf16, fp16 or fp32 checkpoint of the model, or a GGUF file of it")


def load_tensors(headers: list[ShardHeader], device: torch.device, dtype: torch.dtype,
                 progress: Progress | None = None, skip: tuple[str, ...] = (),
                 transform: Transform | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``headers`` on ``device`` in ``dtype`` but those whose names start with
    one of ``skip`` (not read). Every file is opened (safetensors checks its header) and every
    tensor's stored dtype checked before the first is read. ``transform(name, tensor)``, when
    given, replaces each tensor as it is read, on the CPU (a tensor-parallel rank's shard)."""
    wanted = [(h, [n for n in h.entries if not n.startswith(skip)]) for h in headers]
    total, done, tensors = sum(h.entries[n][2] for h, names in wanted for n in names), 0, {}
    with contextlib.ExitStack() as files:
        handles = [files.enter_context(_open(header.path)) for header, _ in wanted]
        _check_dtypes(wanted)
        for (header, names), handle in zip(wanted, handles):
            for name in names:
                tensor = handle.get_tensor(name)
                if transform is not None:
                    tensor = transform(name, tensor)
                tensors[name] = tensor.to(device=device, dtype=dtype)
                done += header.entries[name][2]
                if progress is not None:
                    progress(done, total)
    return tensors


def load_hf_folder_tensors(folder: pathlib.Path, device: torch.device, dtype: torch.dtype,
                           progress: Progress | None = None, unused: tuple[tuple[str, str], ...] = (),
                           transform: Transform | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The weights of an HF folder (single file or sharded), integrity-checked first, but those
    under the ``unused`` (name prefix, what it is) pairs, which are not read; and the line that
    says what was left unread (empty when nothing was). Weights with NaN or inf values are refused."""
    headers = weight_headers(folder)
    tensors = load_tensors(headers, device, dtype, progress, skip=tuple(prefix for prefix, _ in unused),
                           transform=transform)
    check_finite(tensors, {name: h.path for h in headers for name in h.entries})
    return tensors, _unread_line(headers, unused)


def _unread_line(headers: list[ShardHeader], unused: tuple[tuple[str, str], ...]) -> str:
    parts = []
    for prefix, what in unused:
        sizes = [entry[2] for h in headers for name, entry in h.entries.items() if name.startswith(prefix)]
        if sizes:
            parts.append(f"the {what} ({prefix}*: {len(sizes)} tensors, {sum(sizes) / 2**20:.1f} MiB)")
    return "not loaded: " + ", ".join(parts) if parts else ""
