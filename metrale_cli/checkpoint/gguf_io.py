"""GGUF files: read with the ``gguf`` package, dequantize, rename to HF, cache as an HF folder.

Dequantizing every start would cost seconds, so the first load writes the HF-style result
(config.json, tokenizer files, ``model.<dtype>.safetensors``) to ``gguf_cache_path(path)``;
later loads read that folder through the safetensors loader.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from metrale_cli.checkpoint import gguf_config
from metrale_cli.checkpoint.finite import check_finite
from metrale_cli.checkpoint.safetensors_io import Progress, Transform, load_tensors, read_hf_config, read_shard_header
from metrale_cli.environment import cache_dir
from metrale_cli.errors import MetraleError
from metrale_cli.models import family_of, model_config
from metrale_cli.checkpoint.sampling_defaults import GGUF_KEYS, SamplingDefaults, from_gguf_metadata
from metrale_cli.checkpoint.tokenizer import Tokenizer

_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
QUANT_KEY = "gguf_quant"
# The GGML types of the tensors the conversion dequantizes: those the gguf package dequantizes.
# It raises NotImplementedError on the others: integer types and F64 (no weight format of
# llama.cpp's converters), Q8_1 and Q8_K (llama.cpp's activation formats), Q1_0.
DEQUANTIZED = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                         "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                         "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4"})

def gguf_cache_path(path: pathlib.Path | str) -> pathlib.Path:
    """The HF-style folder caching the converted ``path``, keyed by its path, size and mtime."""
    path = pathlib.Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def open_reader(path: pathlib.Path):
    """A ``GGUFReader`` for ``path``; MetraleError when the file is not a whole GGUF file."""
    from gguf import GGUFReader

    if not path.is_file():
        raise MetraleError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(str(path))
    except (ValueError, IndexError, OSError, UnicodeDecodeError) as exc:
        raise MetraleError(f"{path} is not a valid GGUF file or is truncated ({exc})",
                           "re-download the file") from None
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise MetraleError(f"{path} is truncated: tensor data ends at byte {end}",
                           "re-download the file")
    return reader


def metadata(reader) -> dict:
    """GGUF key/value metadata as plain python values."""
    return {name: _value(name, field) for name, field in reader.fields.items()}


def _value(name: str, field):
    """A field's value; its strings are decoded only now, so a corrupt one shows here."""
    try:
        return field.contents()
    except UnicodeDecodeError as exc:
        raise MetraleError(f"the GGUF file's metadata is corrupt: {name} is not UTF-8 text ({exc})",
                           "re-download the file") from None


def tensor_shapes(reader) -> dict[str, tuple[int, ...]]:
    """llama.cpp tensor name -> shape in HF (row-major) order."""
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


def rope_freqs(reader) -> list[float] | None:
    """The per-frequency RoPE divisors llama.cpp stores as ``rope_freqs.weight`` (Llama 3.1's
    llama3 scaling), or None."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return np.asarray(t.data, dtype=np.float32).reshape(-1).tolist()
    return None


def read_gguf_config(path: pathlib.Path) -> dict:
    """The synthesized HF config of a GGUF file (cached config when present)."""
    folder = gguf_cache_path(path)
    if (folder / "config.json").is_file():
        try:
            return read_hf_config(folder)
        except MetraleError:
            pass  # a broken cache entry: the file itself says (the load rebuilds the entry)
    reader = open_reader(path)
    return gguf_config.synthesize_config(metadata(reader), tensor_shapes(reader), rope_freqs(reader))


@dataclass(frozen=True)
class _Part:
    """One HF tensor of a conversion: its name and shape, the GGUF tensor it comes from and, for
    a stacked expert tensor, the expert's slice along dim 0."""

    name: str
    shape: tuple[int, ...]
    source: object  # gguf.ReaderTensor
    expert: int | None


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _per_expert(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A family's stacked expert shapes (``mlp.experts.gate_up_proj`` (E, 2I, H), ``down_proj``
    (E, H, I)) under the per-expert names a GGUF's stacked experts are split into."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".experts.gate_up_proj"):
            e, i2, h = shape
            prefix = name.removesuffix("gate_up_proj")
            out |= {f"{prefix}{x}.{k}_proj.weight": (i2 // 2, h) for x in range(e) for k in ("gate", "up")}
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            out |= {f"{prefix}{x}.down_proj.weight": shape[1:] for x in range(shape[0])}
        else:
            out[name] = shape
    return out


def _check_dequantized(tensor) -> None:
    if tensor.tensor_type.name not in DEQUANTIZED:
        raise MetraleError(f"GGUF tensor {tensor.name} is stored as {tensor.tensor_type.name}, a type metrale "
                           "does not dequantize", "requantize the model with llama.cpp's llama-quantize to a "
                           "type such as Q8_0, Q4_K or F16")


def conversion_plan(reader, config: dict) -> list[_Part]:
    """Every HF tensor the conversion yields, in file order, its GGML type checked against
    DEQUANTIZED and its shape against the one the family expects from ``config`` (older llama.cpp
    converters dropped unit dimensions, e.g. Qwen2-MoE's (1, H) shared-expert gate, which is
    restored)."""
    cfg = model_config(config)
    expected = _per_expert(family_of(cfg.family).expected_tensors(cfg))
    plan = []
    for tensor in reader.tensors:
        declared = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        parts = gguf_config.hf_tensors(tensor.name, declared)
        if parts:
            _check_dequantized(tensor)
        for name, expert in parts:
            shape = declared if expert is None else declared[1:]
            want = expected.get(name, shape)
            if _squeezed(shape) != _squeezed(want):
                raise MetraleError(f"GGUF tensor {tensor.name} has shape {declared}, expected {want}"
                                   + ("" if expert is None else " for each expert"),
                                   "the file does not match its own metadata")
            plan.append(_Part(name, want, tensor, expert))
    return plan


def convert_tensors(reader, config: dict, dtype: torch.dtype,
                    progress: Progress | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every GGUF tensor dequantized, un-permuted where llama.cpp permuted it, stacked experts
    split, under its HF name: (name, CPU tensor of ``dtype``) one at a time, in
    :func:`conversion_plan` order."""
    from gguf.quants import dequantize

    permuted = family_of(config["model_type"]).gguf.permuted_qk
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    plan = conversion_plan(reader, config)
    total = sum(int(t.n_bytes) for t in {id(part.source): part.source for part in plan}.values())
    done, source, values = 0, None, None
    for part in plan:
        if part.source is not source:  # each GGUF tensor is dequantized once
            source, values = part.source, dequantize(part.source.data, part.source.tensor_type)
            done += int(source.n_bytes)
            proj = part.name.split(".")[-2]
            if permuted and proj in heads:
                values = gguf_config.unpermute_qk(values, heads[proj])
        piece = values if part.expert is None else values[part.expert]
        yield part.name, torch.from_numpy(np.array(piece, dtype=np.float32).reshape(part.shape)).to(dtype)
        if progress is not None:
            progress(done, total)


@dataclass(frozen=True)
class GgufModel:
    """A loaded GGUF file: HF-style config, tensors on the target device, tokenizer, and the
    file's main weight type ("Q4_1", "F32", ...)."""

    config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    quant: str
    cache: str = "cached"  # cached (read from the cache) | converted (and cached) | uncached (not writable)


def main_quant(reader) -> str:
    """The most common type among the file's matrices (embeddings, norms may differ)."""
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return kinds.most_common(1)[0][0] if kinds else "F32"


def read_gguf_tokenizer(path: pathlib.Path) -> Tokenizer:
    """The tokenizer of a GGUF file: from its conversion cache when there is one, else from the
    file's metadata (no tensor is read)."""
    folder = gguf_cache_path(path)
    if (folder / "config.json").is_file():
        try:
            return Tokenizer.from_hf_folder(folder)
        except MetraleError:
            pass  # an incomplete cache entry: the file itself says
    return Tokenizer.from_gguf(metadata(open_reader(path)))


SAMPLING_FILE = "sampling.json"  # a conversion cache's copy of the file's general.sampling.* keys


def read_gguf_sampling(path: pathlib.Path) -> SamplingDefaults:
    """A GGUF file's recommended sampling: from its conversion cache when there is one, else from
    the file's general.sampling.* keys alone (its vocabulary is not converted to read them)."""
    cached = gguf_cache_path(path) / SAMPLING_FILE
    if cached.is_file():
        try:
            return from_gguf_metadata(json.loads(cached.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            pass  # a broken cache entry: the file itself says
    return from_gguf_metadata(_sampling_keys(open_reader(path)))


def _sampling_keys(reader) -> dict:
    return {key: _value(key, reader.fields[key]) for key in GGUF_KEYS if key in reader.fields}


def load_gguf(path: pathlib.Path, device: torch.device, dtype: torch.dtype,
              progress: Progress | None = None, transform: Transform | None = None) -> GgufModel:
    """Config, tensors on ``device`` (floats in ``dtype``, each through ``transform`` when given,
    as load_tensors) and tokenizer of a GGUF file.

    Served from ``gguf_cache_path(path)`` when converted before; converted and cached otherwise.
    Weights with NaN or inf values once dequantized are refused, the GGUF file named (not its
    cache: rebuilding that would convert them again).
    """
    model = _load_or_convert(path, device, dtype, progress, transform)
    check_finite(model.tensors, dict.fromkeys(model.tensors, path))
    return model


def _load_or_convert(path: pathlib.Path, device: torch.device, dtype: torch.dtype,
                     progress: Progress | None, transform: Transform | None) -> GgufModel:
    folder = gguf_cache_path(path)
    weights = folder / f"model.{str(dtype).removeprefix('torch.')}.safetensors"
    if weights.is_file():
        try:
            header = read_shard_header(weights)
            tensors = load_tensors([header], device, dtype, progress, transform=transform)
            return GgufModel(read_hf_config(folder), tensors, Tokenizer.from_hf_folder(folder),
                             header.metadata.get(QUANT_KEY, "?"))
        except MetraleError:
            shutil.rmtree(folder, ignore_errors=True)  # a broken cache entry of ours: rebuild it
    reader = open_reader(path)
    meta = metadata(reader)
    config = gguf_config.synthesize_config(meta, tensor_shapes(reader), rope_freqs(reader))
    tokenizer, quant = Tokenizer.from_gguf(meta), main_quant(reader)
    entries = _entries(reader, config, dtype)  # every tensor's type and shape checked before the wait starts
    describe = getattr(progress, "describe", None)  # Output.progress's: say what the wait is
    if describe is not None:
        then = "once, then read from the cache" if _writable(folder) else "at every start (the cache is not writable)"
        describe(f"converting {path.name} ({quant}) to {str(dtype).removeprefix('torch.')} safetensors: {then}")
    try:
        _write_cache(folder, weights, config, tokenizer, _sampling_keys(reader), quant, dtype,
                     convert_tensors(reader, config, dtype, progress), entries)
    except OSError:  # an unwritable cache only costs the next start the same conversion
        tensors = {name: (t if transform is None else transform(name, t)).to(device)
                   for name, t in convert_tensors(reader, config, dtype, progress)}
        return GgufModel(config, tensors, tokenizer, quant, "uncached")
    return GgufModel(config, load_tensors([read_shard_header(weights)], device, dtype, transform=transform), tokenizer,
                     quant, "converted")


def _writable(folder: pathlib.Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def _entries(reader, config: dict, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], int]]:
    """HF name -> (shape, bytes) of every weight the conversion yields, in file order."""
    size = torch.tensor([], dtype=dtype).element_size()
    return {p.name: (p.shape, int(np.prod(p.shape)) * size) for p in conversion_plan(reader, config)}


def _write_cache(folder: pathlib.Path, weights: pathlib.Path, config: dict, tokenizer: Tokenizer, sampling: dict,
                 quant: str, dtype: torch.dtype, tensors: Iterator[tuple[str, torch.Tensor]],
                 entries: dict[str, tuple[tuple[int, ...], int]]) -> None:
    """The HF-style folder of a converted GGUF (``sampling``: its general.sampling.* keys). The
    safetensors file is written as the tensors come (its header first, from the shapes), so the
    host holds one converted tensor at a time; under a temp name until the tokenizer, config and
    sampling are written too: a weights file present means the folder is complete."""
    folder.mkdir(parents=True, exist_ok=True)
    header, offset = {"__metadata__": {"format": "pt", QUANT_KEY: quant}}, 0
    for name, (shape, nbytes) in entries.items():
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    partial = weights.with_suffix(f".partial.{os.getpid()}")  # tensor-parallel ranks convert side by side
    try:
        with open(partial, "wb") as out:
            out.write(len(raw).to_bytes(8, "little") + raw)
            for name, tensor in tensors:
                data = tensor.contiguous().view(torch.uint8).numpy()
                if out.tell() - 8 - len(raw) != header[name]["data_offsets"][0] or data.nbytes != entries[name][1]:
                    raise MetraleError(f"GGUF tensor {name} does not match the cache header written for it")
                out.write(data.tobytes())
        tokenizer.save(folder)
        (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        (folder / SAMPLING_FILE).write_text(json.dumps(sampling), encoding="utf-8")
        os.replace(partial, weights)
    finally:
        partial.unlink(missing_ok=True)
