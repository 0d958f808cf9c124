"""Reading a Hugging Face model directory: ``config.json`` and safetensors weights, without
transformers.

Weights are ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> file), or, without an index, every ``*.safetensors`` file of the
directory. Tensors are read with the ``safetensors`` package (``safe_open``, which
memory-maps each file) and converted to float32 numpy arrays. Token lookups read rows straight
from a memory map of the tensor's bytes (:class:`SafetensorsRows`), located with the file's
header (8 bytes of little-endian header length, then a JSON object: per tensor ``dtype``,
``shape`` and ``data_offsets`` relative to the end of the header; the format's specification).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from app.models.architectures import Architecture, for_hf_model_type
from app.models.checkpoints.checkpoint import CheckpointFormat
from app.models.checkpoints.hf_config import hparams_from_config
from app.models.checkpoints.q4_codes import Q4Codes
from app.models.hparams import HParams
from app.models.refusal import UnsupportedModel

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SUPPORTED_DTYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True, slots=True)
class _TensorEntry:
    """Where one tensor is: its file, dtype, shape and byte range in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class HFDirectory:
    """A Hugging Face model directory opened read-only.

    Raises (constructor):
        UnsupportedModel: no config.json, a config.json that is not JSON, no safetensors files
            (e.g. only ``pytorch_model.bin``), a missing shard, or a broken safetensors header.
    """

    format = CheckpointFormat.SAFETENSORS

    def __init__(self, path: Path) -> None:
        self.path = path
        config_path = path / CONFIG_FILE
        if not config_path.is_file():
            raise UnsupportedModel("no config.json (not a Hugging Face model directory)")
        try:
            self.config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise UnsupportedModel(f"config.json is not valid JSON ({error})") from None
        if not isinstance(self.config, dict):
            kind = type(self.config).__name__
            raise UnsupportedModel(f"config.json is not a JSON object (a {kind})")
        self._entries = _index(path)
        self._handles: dict[Path, Any] = {}

    @property
    def default_name(self) -> str:
        """The directory's name (vLLM serves a local path under its own name)."""
        return self.path.resolve().name

    def architecture(self) -> Architecture:
        return for_hf_model_type(str(self.config.get("model_type", "")))

    def hparams(self, architecture: Architecture) -> HParams:
        return hparams_from_config(
            self.config,
            architecture,
            has_output_weight=self.has_tensor(architecture.hf_names.of("output")),
        )

    def tensor_names(self) -> list[str]:
        return list(self._entries)

    def has_tensor(self, name: str) -> bool:
        return name in self._entries

    def tensor_type(self, name: str) -> str:
        return self._entries[name].dtype

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def unsupported_tensor(self) -> tuple[str, str] | None:
        for name, entry in self._entries.items():
            if entry.dtype not in SUPPORTED_DTYPES:
                return name, entry.dtype
        return None

    def read_tensor(self, name: str) -> np.ndarray:
        """float32, a writable copy (``safe_open``'s tensor widened exactly)."""
        entry = self._entries[name]
        handle = self._handles.get(entry.file)
        if handle is None:
            handle = self._handles[entry.file] = safe_open(entry.file, framework="pt")
        tensor: torch.Tensor = handle.get_tensor(name)
        widened = tensor.to(torch.float32)
        if widened is tensor:  # a float32 file: get_tensor's memory is shared between calls
            return np.array(widened.numpy(), order="C", copy=True)
        return np.ascontiguousarray(widened.numpy())

    def q4_codes(self, name: str) -> Q4Codes | None:
        """None: safetensors hold float weights only."""
        return None

    def raw_blocks(self, name: str) -> None:
        """None: safetensors hold float weights only."""
        return None

    def release_pages(self) -> None:
        """Nothing: safetensors tensors are read through handles, not one mapping."""

    def tensor_rows(self, name: str) -> SafetensorsRows:
        entry = self._entries[name]
        rows, columns = entry.shape
        raw_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[entry.dtype]
        raw = np.memmap(
            entry.file, dtype=raw_dtype, mode="r", offset=entry.begin, shape=(rows, columns)
        )
        return SafetensorsRows(raw, bfloat16=entry.dtype == "BF16")


@dataclass(frozen=True, slots=True)
class SafetensorsRows:
    """Rows of one safetensors matrix on demand
    (:class:`app.models.checkpoints.checkpoint.TensorRows`),
    widened to float32 exactly, as :meth:`HFDirectory.read_tensor` widens the whole matrix."""

    raw: np.ndarray  # memory-mapped [rows, columns]: float32, float16, or bfloat16 as uint16
    bfloat16: bool

    def rows(self, ids: np.ndarray) -> np.ndarray:
        picked = self.raw[ids]
        if self.bfloat16:  # a bfloat16 is the upper half of a float32
            return (picked.astype(np.uint32) << 16).view(np.float32)
        return picked.astype(np.float32)


def _index(directory: Path) -> dict[str, _TensorEntry]:
    """Every tensor of the directory's safetensors files, by name."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise UnsupportedModel(f"{INDEX_FILE} has no weight_map ({error})") from None
        files = sorted({directory / file for file in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in directory.glob("*.bin")) or ["no weight files"]
        raise UnsupportedModel(
            f"no *.safetensors weights (found {', '.join(found)}; only safetensors are supported)"
        )
    entries: dict[str, _TensorEntry] = {}
    for file in files:
        if not file.is_file():
            raise UnsupportedModel(f"{INDEX_FILE} lists {file.name}, which is missing")
        entries.update(_read_header(file))
    return entries


def _read_header(file: Path) -> dict[str, _TensorEntry]:
    """The tensors a safetensors file's header lists, each checked to lie inside the file.

    Raises:
        UnsupportedModel: not a safetensors file, a malformed header, or a file shorter than
            its header says (truncated: a download or copy that stopped early).
    """
    size = file.stat().st_size
    with file.open("rb") as stream:
        prefix = stream.read(8)
        if len(prefix) != 8:
            raise UnsupportedModel(f"{file.name} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            raise UnsupportedModel(
                f"{file.name} is truncated: its header needs {8 + length} bytes, the file has "
                f"{size}"
            )
        try:
            header = json.loads(stream.read(length))
        except (ValueError, UnicodeDecodeError, MemoryError, OverflowError):
            raise UnsupportedModel(f"{file.name} is not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise UnsupportedModel(f"{file.name} is not a safetensors file (bad header)")
    start = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(offset) for offset in info["data_offsets"])
            shape = tuple(int(n) for n in info["shape"])
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise UnsupportedModel(
                f"{file.name} is not a safetensors file (bad header entry for {name})"
            ) from None
        if not 0 <= begin <= end:
            raise UnsupportedModel(
                f"{file.name} is not a safetensors file (bad offsets for {name})"
            )
        if start + end > size:
            raise UnsupportedModel(
                f"{file.name} is truncated: {name} ends at byte {start + end}, the file has {size}"
            )
        entries[name] = _TensorEntry(file, dtype, shape, start + begin, start + end)
    covered = max((entry.end for entry in entries.values()), default=start)
    if covered != size:
        raise UnsupportedModel(
            f"{file.name} is not a safetensors file (its tensors cover {covered} of its {size} "
            "bytes)"
        )
    return entries
