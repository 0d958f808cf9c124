"""What the weight loader needs from a checkpoint file format (GGUF, a safetensors directory).

A format reader (:class:`app.models.checkpoints.gguf_file.GGUFFile`,
:class:`app.models.checkpoints.hf_directory.HFDirectory`) knows its files' layout: names, dtypes
and block
layouts, where the bytes are. It knows nothing of architectures: which tensor means what, and
whether rows must be un-permuted, is :mod:`app.models.checkpoints.model_tensors`' business.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Protocol

import numpy as np

from app.models.architectures import Architecture
from app.models.checkpoints.q4_codes import Q4Codes
from app.models.hparams import HParams
from app.models.refusal import UnsupportedModel

__all__ = ["Checkpoint", "CheckpointFormat", "TensorRows", "UnsupportedModel"]


class CheckpointFormat(Enum):
    """Which names and layout a checkpoint uses (:class:`app.models.architectures.TensorNames`)."""

    GGUF = "gguf"
    SAFETENSORS = "safetensors"


class TensorRows(Protocol):
    """Rows of one matrix, read on demand from the file (a memory map): token lookups without a
    copy of the embedding in memory."""

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 ``[len(ids), columns]`` for int64 ``ids``; the very values
        :meth:`Checkpoint.read_tensor` gives for those rows."""
        ...


class Checkpoint(Protocol):
    """A model file (or directory) opened read-only:
    :class:`app.models.checkpoints.gguf_file.GGUFFile`,
    :class:`app.models.checkpoints.hf_directory.HFDirectory`.

    Tensor names are the format's own; shapes are numpy order (``[out, in]`` for a matrix).
    Types are named as GGUF names them (``"F32"``, ``"BF16"``, ``"Q4_1"``, ...).
    """

    path: Path
    format: CheckpointFormat

    @property
    def default_name(self) -> str:
        """The name to serve the model under when the user gives none."""
        ...

    def architecture(self) -> Architecture:
        """The architecture the file declares. Raises UnsupportedArchitecture (naming it)."""
        ...

    def hparams(self, architecture: Architecture) -> HParams:
        """The model's hyper-parameters. Raises UnsupportedModel."""
        ...

    def tensor_names(self) -> list[str]: ...

    def has_tensor(self, name: str) -> bool: ...

    def tensor_type(self, name: str) -> str: ...

    def tensor_shape(self, name: str) -> tuple[int, ...]: ...

    def read_tensor(self, name: str) -> np.ndarray:
        """The tensor as float32, C-contiguous and writable (a copy)."""
        ...

    def tensor_rows(self, name: str) -> TensorRows:
        """A memory-mapped row reader of the 2-D tensor ``name``."""
        ...

    def q4_codes(self, name: str) -> Q4Codes | None:
        """The matrix's 4-bit codes and scales when the file stores it as Q4_0 or Q4_1 (the
        int4 kernel computes with them as they are), else None."""
        ...

    def raw_blocks(self, name: str) -> np.ndarray | None:
        """The matrix's rows as the file stores them, uint8 ``[rows, bytes per row]`` (a
        read-only view of the file, no copy), or None for a format without quantised blocks."""
        ...

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory (they stay in the page
        cache and come back if read again): after the weights are copied out."""
        ...

    def unsupported_tensor(self) -> tuple[str, str] | None:
        """``(name, type)`` of the first tensor whose type this server cannot read, or None."""
        ...
