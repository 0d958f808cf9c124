"""Projections: how ``y = x @ W.T (+ b)`` is computed for one weight matrix.

A projection is anything with the small :class:`Projection` protocol; the forward does not
know which kind it holds. Kinds: :class:`DenseLinear` (``F.linear``, any device and dtype),
:class:`PackedLinear` (bfloat16 weights in oneDNN's blocked layout, CPU), and the weight-only
quantised ones in :mod:`app.models.int8` and :mod:`app.models.int4`. How a dense projection is
computed is chosen once, at load, by :func:`select_linear_kernel` (rule R14).

Batch invariance (API.md: a seeded request gets the same tokens whatever else is in the batch).
Measured on the 2-core CPU (torch 2.13, docs/MODEL_PERF.md, "Batch invariance"): a bfloat16
matmul (oneDNN, packed or not, with or without the fused add) computes each row of a call of
at most 32 rows exactly as it computes that row alone; from 33 rows on, some rows come out one
rounding different. Each projection declares ``exact_rows``, the most rows one call may hold so
that every row comes out as it would alone, and :func:`project` computes the rows that must be
exact in calls of that size.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch
import torch.nn.functional as F

EXACT_ROWS_ONEDNN_BF16 = 32


class Projection(Protocol):
    """``y = x @ W.T (+ bias)`` for ``x [M, in]`` -> ``[M, out]`` in the model dtype.

    Attributes:
        exact_rows: most rows one call may hold so that each row's result equals that row's
            result alone (see the module docstring).
    """

    exact_rows: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W.T (+ bias)``; ``residual`` is not modified."""
        ...


class LinearKernel(Enum):
    """How a dense (unquantised) projection is computed.

    DENSE: ``F.linear`` on a plain ``[out, in]`` weight; any device, any dtype.
    ONEDNN: bfloat16 on a CPU with oneDNN: the weight is reordered once, at load, into oneDNN's
        blocked layout (``mkldnn._reorder_linear_weight``) and multiplied with
        ``mkldnn._linear_pointwise``. ``F.linear`` reorders a bfloat16 weight on every call;
        measured on the 2-core CPU, the packed weight is ~1.5x faster at 1 row and ~1.3x at 64.
    """

    DENSE = "dense"
    ONEDNN = "onednn"


def exact_rows_per_call(device: torch.device, dtype: torch.dtype) -> int:
    """Most rows one dense matmul call may hold so that every row's result equals the result
    of that row alone: 32 for bfloat16 on the CPU (measured), else 1 (float32 on the CPU takes
    a GEMV for one row and a GEMM, with other roundings, for more; other devices unmeasured)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return EXACT_ROWS_ONEDNN_BF16
    return 1


def select_linear_kernel(device: torch.device, dtype: torch.dtype) -> tuple[LinearKernel, str]:
    """The fastest dense projection kernel that works here, and why (rule R14)."""
    if device.type != "cpu":
        return LinearKernel.DENSE, f"F.linear on {device.type}"
    if dtype != torch.bfloat16:
        return LinearKernel.DENSE, f"F.linear: oneDNN packing is used for bfloat16 only ({dtype})"
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return LinearKernel.DENSE, "F.linear: this CPU or torch build has no oneDNN bfloat16"
    try:
        probe = torch.ones(8, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe)
        result = torch.ops.mkldnn._linear_pointwise(probe[:1], packed, None, "none", [], "")
        if result.shape != (1, 8) or result.float()[0, 0].item() != 16.0:
            return LinearKernel.DENSE, "F.linear: oneDNN packed matmul gave a wrong probe result"
    except RuntimeError as error:
        return LinearKernel.DENSE, f"F.linear: oneDNN packed matmul unavailable ({error})"
    return LinearKernel.ONEDNN, "oneDNN packed bfloat16 weights"


@dataclass(frozen=True, slots=True)
class DenseLinear:
    """``y = x @ weight.T + bias`` with ``weight [out, in]`` (and ``bias [out]``) in the model
    dtype. ``exact_rows``: see :func:`exact_rows_per_call`."""

    weight: torch.Tensor
    exact_rows: int = 1
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``; the add in the matmul's kernel."""
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """``y = x @ weight.T + bias`` with the weight in oneDNN's blocked layout (see
    :class:`LinearKernel`). ``packed`` is an opaque ``torch._mkldnn`` tensor; ``x`` must be
    contiguous bfloat16 on the CPU."""

    packed: torch.Tensor
    bias: torch.Tensor | None = None
    exact_rows = EXACT_ROWS_ONEDNN_BF16

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``, the add fused into the matmul's epilogue."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")


WideLinear = DenseLinear | PackedLinear


def dense_projection(
    weight: torch.Tensor, kernel: LinearKernel, bias: torch.Tensor | None = None
) -> WideLinear:
    """A dense projection of ``weight [out, in]`` (already in the model dtype and on its
    device), with ``bias [out]`` in the same dtype or None."""
    if kernel is LinearKernel.ONEDNN:
        return PackedLinear.pack(weight, bias)
    exact = exact_rows_per_call(weight.device, weight.dtype)
    return DenseLinear(weight.contiguous(), exact, bias)


def project(
    linear: Projection,
    x: torch.Tensor,
    exact: torch.Tensor | None,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T`` (plus ``residual`` when given) for ``x [N, in]``, with the rows listed in
    ``exact`` (int64 indices, or None) computed in calls of at most ``linear.exact_rows`` rows,
    so that each comes out as it would alone. The other rows take one call over all ``N``
    (their results there are overwritten for the exact rows)."""

    def call(rows_x: torch.Tensor, rows_residual: torch.Tensor | None) -> torch.Tensor:
        if rows_residual is None:
            return linear(rows_x)
        return linear.add_to(rows_residual, rows_x)

    rows, step = x.shape[0], linear.exact_rows
    if exact is None or rows <= step:
        return call(x, residual)
    if exact.numel() == rows:  # every row is exact: no call over all of them
        return torch.cat(
            [
                call(x[i : i + step], None if residual is None else residual[i : i + step])
                for i in range(0, rows, step)
            ]
        )
    out = call(x, residual)
    for chunk in exact.split(step):
        chunk_residual = None if residual is None else residual.index_select(0, chunk)
        out.index_copy_(0, chunk, call(x.index_select(0, chunk), chunk_residual))
    return out
