"""Token lookups: ``[N]`` int64 token ids -> ``[N, hidden]`` rows in the model dtype.

Kinds: :class:`DenseEmbedding` (a matrix in memory, often the very tensor of a tied LM head),
:class:`FileRowsEmbedding` (rows read from the checkpoint's memory map on demand) and
:class:`app.models.weights.int8.Int8Embedding` (the rows of a tied int8 LM head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from app.models.checkpoints.checkpoint import TensorRows


class Embedding(Protocol):
    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64 ids -> ``[N, hidden]`` in the model dtype, on the model device."""
        ...


@dataclass(frozen=True, slots=True)
class DenseEmbedding:
    """Token lookup in ``weight [vocab, hidden]`` (model dtype)."""

    weight: torch.Tensor

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


@dataclass(frozen=True, slots=True)
class FileRowsEmbedding:
    """Token lookup that reads each row from the checkpoint's memory map
    (:meth:`app.models.checkpoints.checkpoint.Checkpoint.tensor_rows`), for a model whose LM head
    cannot
    serve lookups (packed for oneDNN) or whose embedding is not tied to it. No copy of the
    ``[vocab, hidden]`` matrix is kept in memory; the pages of the rows looked up become file
    cache (shared and reclaimable).

    The rows are decoded as the loader decodes whole tensors, then rounded to ``dtype``: the
    very numbers of the dense matrix an LM head tied to it was built from. CPU only.
    """

    source: TensorRows
    dtype: torch.dtype

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        values = self.source.rows(token_ids.numpy())
        return torch.from_numpy(values).to(self.dtype)
