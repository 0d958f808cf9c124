"""Projections: how ``y = x @ W.T (+ b)`` is computed for one weight matrix.

A projection is anything with the small :class:`Projection` protocol; the forward does not
know which kind it holds. Kinds: :class:`DenseLinear` (``F.linear``, any device and dtype),
:class:`PackedLinear` (bfloat16 weights in oneDNN's blocked layout, CPU), and the weight-only
quantised ones in :mod:`app.models.weights.int8` and :mod:`app.models.weights.int4`. How a dense
projection is
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

import functools
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
    ONEDNN: bfloat16 on a CPU with oneDNN bfloat16 (AVX512-BW/VL/DQ or AVX-NE-CONVERT): the
        weight is reordered once, at load, into oneDNN's blocked layout
        (``mkldnn._reorder_linear_weight``) and multiplied with ``mkldnn._linear_pointwise``.
        ``F.linear`` reorders a bfloat16 weight on every call; measured on the 2-core AMX CPU,
        the packed weight is ~1.5x faster at 1 row and ~1.3x at 64.
    ONEDNN_FLOAT32: the same packed oneDNN matmul over float32 weights, on a CPU for a float32
        model, and for a bfloat16 model where the CPU has no bfloat16 matmul (AVX2: there
        ``F.linear`` emulates bfloat16 at ~10 GFLOP/s). A bfloat16 model's weights keep their
        bfloat16 values, widened once at load (twice their memory); its activations are
        widened per call and each result rounded to bfloat16 once. Measured on a 2-core AVX2
        EPYC (all five SmolLM2 projection shapes, the LM head too, ms a step): 1 row 6.7 against
        bfloat16 ``F.linear``'s 7.0; 16 rows 20 against 101; 64 rows 61 against 402; and 1.8x
        float32 ``F.linear`` (MKL) at 1 row, 3.4x at 16.
    """

    DENSE = "dense"
    ONEDNN = "onednn"
    ONEDNN_FLOAT32 = "onednn-float32"


# Row counts a batch-invariance probe checks (every count up to 9, then around the powers of
# two where GEMM kernels change their blocking), and the most rows it can grant.
_PROBE_ROWS = (*range(1, 10), 15, 16, 17, 24, 31, 32, 33, 47, 48, 63, 64)
EXACT_ROWS_MAX = 64


def exact_rows_per_call(device: torch.device, dtype: torch.dtype, in_features: int) -> int:
    """Most rows one ``F.linear`` call (:attr:`LinearKernel.DENSE`) of ``in_features`` input
    columns may hold so that every row's result equals the result of that row alone: for
    bfloat16 on the CPU, oneDNN's bfloat16 GEMM, probed (:func:`packed_exact_rows`); else 1
    (float32 on the CPU takes a GEMV for one row and a GEMM, with other roundings, for more;
    other devices unmeasured)."""
    if device.type == "cpu" and dtype == torch.bfloat16 and _onednn_bfloat16_supported():
        return packed_exact_rows(torch.bfloat16, in_features)
    return 1


def _onednn_bfloat16_supported() -> bool:
    """Whether oneDNN computes bfloat16 natively here (reads the CPU's flags; runs nothing)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def widens_to_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` model's dense projections here will hold float32 copies of their
    weights (:attr:`LinearKernel.ONEDNN_FLOAT32` for bfloat16): what the memory estimate
    counts before any kernel has run. Reads the CPU's flags only."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and not _onednn_bfloat16_supported()
    )


def select_linear_kernel(device: torch.device, dtype: torch.dtype) -> tuple[LinearKernel, str]:
    """The fastest dense projection kernel that works here, and why (rule R14).

    Runs small probe matmuls (call it where the model's kernels will run: the model thread)."""
    if device.type != "cpu":
        return LinearKernel.DENSE, f"F.linear on {device.type}"
    if dtype not in (torch.bfloat16, torch.float32):
        return (
            LinearKernel.DENSE,
            f"F.linear: oneDNN packing is used for bfloat16 and float32 only ({dtype})",
        )
    if not torch.backends.mkldnn.is_available():
        return LinearKernel.DENSE, "F.linear: this torch build has no oneDNN"
    if dtype == torch.bfloat16 and _onednn_bfloat16_supported():
        failure = _probe_packed(torch.bfloat16)
        if failure is None:
            return LinearKernel.ONEDNN, "oneDNN packed bfloat16 weights"
        return LinearKernel.DENSE, f"F.linear: {failure}"
    failure = _probe_packed(torch.float32)
    if failure is not None:
        return LinearKernel.DENSE, f"F.linear: {failure}"
    if dtype == torch.float32:
        return LinearKernel.ONEDNN_FLOAT32, "oneDNN packed float32 weights"
    return LinearKernel.ONEDNN_FLOAT32, (
        "oneDNN packed float32 copies of the bfloat16 weights: this CPU has no bfloat16 "
        "matmul (oneDNN needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)"
    )


def _probe_packed(dtype: torch.dtype) -> str | None:
    """None when a oneDNN packed ``dtype`` matmul gives a known result here, else why not."""
    try:
        probe = torch.ones(8, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe)
        result = torch.ops.mkldnn._linear_pointwise(probe[:1], packed, None, "none", [], "")
    except RuntimeError as error:
        return f"oneDNN packed {dtype} matmul unavailable ({error})"
    if result.shape != (1, 8) or result.float()[0, 0].item() != 16.0:
        return f"oneDNN packed {dtype} matmul gave a wrong probe result"
    return None


@functools.cache
def packed_exact_rows(compute_dtype: torch.dtype, in_features: int) -> int:
    """Most rows one packed oneDNN call (:class:`PackedLinear` in ``compute_dtype``) with
    ``in_features`` input columns may hold so that every row comes out as it does alone,
    measured here once per process and width: random ``[64, in_features] x [576,
    in_features]`` calls of each of ``_PROBE_ROWS`` rows, plain and with the residual added
    (``add_to``), against one-row calls (bitwise), with the torch threads of the moment and
    with one thread (a server may run with ``--torch-threads 1``); the least of them.

    The width matters, and so does the CPU. On the 2-core AVX2 EPYC every SmolLM2 shape up to
    128 rows came out exact in float32; on the 2-core AMX Xeon bfloat16 calls of up to 32 rows.
    On a 2-core AVX-512 EPYC (Zen 4, bfloat16 native) widths of 576 are exact up to 64 rows,
    while 1,536 (SmolLM2's down projection) gives 6 rows in bfloat16 and 1 in float32, and
    1 with one thread: oneDNN splits the reduction differently with the row count there. A
    constant per kernel made seeded requests differ in a crowd on that CPU."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(576, in_features, generator=generator).to(torch.bfloat16)
    x = torch.randn(EXACT_ROWS_MAX, in_features, generator=generator).to(torch.bfloat16)
    residual = torch.randn(EXACT_ROWS_MAX, 576, generator=generator).to(torch.bfloat16)
    linear = PackedLinear.pack(weight.to(compute_dtype), exact_rows=1)
    x, residual = x.to(compute_dtype), residual.to(compute_dtype)
    threads = torch.get_num_threads()
    exact = EXACT_ROWS_MAX
    try:
        for count in sorted({threads, 1}):
            torch.set_num_threads(count)
            for call in (linear, lambda rows: linear.add_to(residual[: rows.shape[0]], rows)):
                alone = torch.cat([call(x[row : row + 1]) for row in range(EXACT_ROWS_MAX)])
                agreed = 1
                for rows in _PROBE_ROWS:
                    if not torch.equal(call(x[:rows]), alone[:rows]):
                        break
                    agreed = rows
                exact = min(exact, agreed)
    finally:
        torch.set_num_threads(threads)
    return exact


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
    :class:`LinearKernel`). ``packed`` is an opaque ``torch._mkldnn`` tensor of
    ``compute_dtype`` (bfloat16 or float32), ``bias`` ``[out]`` in ``compute_dtype`` or None.
    ``x`` must be contiguous on the CPU; when its dtype is not ``compute_dtype`` (a bfloat16
    model over float32 weights) it is widened for the call and the result, ``residual`` added
    in ``compute_dtype``, is rounded back to ``x``'s dtype once."""

    packed: torch.Tensor
    bias: torch.Tensor | None = None
    exact_rows: int = EXACT_ROWS_ONEDNN_BF16
    compute_dtype: torch.dtype = torch.bfloat16

    @classmethod
    def pack(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        compute_dtype: torch.dtype | None = None,
        exact_rows: int = EXACT_ROWS_ONEDNN_BF16,
    ) -> PackedLinear:
        """Reorder ``weight [out, in]`` (and cast it and ``bias`` to ``compute_dtype``, by
        default the weight's own dtype)."""
        dtype = weight.dtype if compute_dtype is None else compute_dtype
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype).contiguous())
        return cls(packed, None if bias is None else bias.to(dtype), exact_rows, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.compute_dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        wide = x.to(self.compute_dtype)
        out = torch.ops.mkldnn._linear_pointwise(wide, self.packed, self.bias, "none", [], "")
        return out.to(x.dtype)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``, the add fused into the matmul's epilogue."""
        add = torch.ops.mkldnn._linear_pointwise.binary
        if x.dtype == self.compute_dtype:
            return add(x, residual, self.packed, self.bias, "add")
        wide_x, wide_residual = x.to(self.compute_dtype), residual.to(self.compute_dtype)
        return add(wide_x, wide_residual, self.packed, self.bias, "add").to(x.dtype)


WideLinear = DenseLinear | PackedLinear


def dense_projection(
    weight: torch.Tensor, kernel: LinearKernel, bias: torch.Tensor | None = None
) -> WideLinear:
    """A dense projection of ``weight [out, in]`` (already in the model dtype and on its
    device), with ``bias [out]`` in the same dtype or None."""
    if kernel is LinearKernel.ONEDNN:
        exact = packed_exact_rows(torch.bfloat16, weight.shape[1])
        return PackedLinear.pack(weight, bias, exact_rows=exact)
    if kernel is LinearKernel.ONEDNN_FLOAT32:
        exact = packed_exact_rows(torch.float32, weight.shape[1])
        return PackedLinear.pack(weight, bias, compute_dtype=torch.float32, exact_rows=exact)
    exact = exact_rows_per_call(weight.device, weight.dtype, weight.shape[1])
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
    (their results there are overwritten for the exact rows); where that call's dtype is not
    the exact calls' (an LM head's bfloat16 dense copy beside float32 sums on GGUF blocks),
    the result takes the exact calls' dtype, so those rows keep their values."""

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
        rows_out = call(x.index_select(0, chunk), chunk_residual)
        if rows_out.dtype != out.dtype:  # an LM head's bfloat16 wide call, float32 blocks
            out = out.to(rows_out.dtype)
        out.index_copy_(0, chunk, rows_out)
    return out
