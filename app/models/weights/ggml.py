"""Projections and token lookups that compute on a GGUF file's own blocks (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), through :mod:`app.models.kernels.ggml_quant`.

The blocks are the file's bytes, mapped or copied into 2 MiB pages at load
(:mod:`app.models.weights.block_arena`; Q4_0-Q8_0 and Q4_K rows interleaved eight at a time on
the way, ``QuantSegment.interleaved``), and no dense copy of a quantised weight is made: a
model's resident weights are the file's bytes. The RMSNorm weights cannot be folded into the
input columns (a block's scale is shared by 32 or 256 columns), so a model using
:class:`GGMLLinear` applies ``attn_norm`` / ``ffn_norm`` to the activations, as with int4.

Every row of a call is computed alone (see the kernels' module): ``exact_rows`` is unbounded.

Where no copy is kept but the CPU multiplies bfloat16 on AMX tiles, a call of
at least ``dense_from_rows`` rows (a long prompt's chunk) decodes the blocks into a bfloat16
matrix for that call only and runs oneDNN's GEMM over it: the block kernels are GEMV-shaped,
and a 1B Q4_K layer's four projections over 512 rows took 575 ms on the blocks against 173 ms
decoded per call on the 2-core AMX Xeon; without AMX the blocks' VNNI tiles win (the Zen 4
EPYC: 0.61-0.88x the decode and GEMM's time at 128-512 rows; docs/MODEL_PERF.md).
The decoded matrix is written into one buffer per thread, reused (the 1B file's largest
matrix: 64 MiB, counted by the memory estimate). Then a row is batch-invariant up to
``dense_from_rows - 1`` rows a call.

A model may also keep a dense copy for wide steps (``wide``; ``--wide-copies``, by default only
where the copies come to at most 512 MiB: memory at the file's size is the point for real-sized
files): the block kernels are a GEMV at heart, and with AMX, from ``GGML_MAX_ROWS + 1`` rows
on, oneDNN's GEMM over dense weights is as fast or faster; without AMX only from
``GGML_MAX_ROWS_NO_AMX + 1`` (:func:`blocks_max_rows`). Then a row is batch-invariant up to
``blocks_max_rows`` rows a call, as with int4.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.models.kernels.ggml_quant import GGMLKernels, PreparedSegments, QuantSegment
from app.models.weights.head_sketch import HeadSketch
from app.models.weights.projections import WideLinear

# Any number of rows per call computes each row as it would alone.
EXACT_ROWS_ANY = 2**31 - 1
# With a wide copy: calls of up to this many rows take the block kernels, larger ones the copy,
# on a CPU with AMX (oneDNN's bfloat16 GEMM on tiles): served side by side on the 2-core AMX
# Xeon with the K formats' tiles, the blocks against the copies gave SmolLM2 1.32x the tok/s at
# 16 streams, 1.15x at 32, 1.03x at 64, and Gemma 3 270M 1.23x at 16, 1.01x at 32, 0.89x at 64
# (its 262k-row head). Without AMX (AVX-512 BF16 only) the
# block kernels beat the copies' GEMM from 8 to 128 decode rows (SmolLM2's Q4_1 tiles: a step
# 0.70x the copies' time at 8 rows, 0.86-0.93x at 16-128; Gemma 3's K formats 0.78-0.91x; a
# 2-core AVX-512 EPYC, docs/MODEL_PERF.md), and the copies pay only for a prompt's chunk
# (SmolLM2's 128-512-token prefill 1.23-1.59x faster on them): there calls take the blocks up to
# GGML_MAX_ROWS_NO_AMX rows.
GGML_MAX_ROWS = 32
GGML_MAX_ROWS_NO_AMX = 127
# Without one, on a CPU with AMX tiles: calls of at least this many rows decode the blocks for
# the call (measured on the 2-core AMX Xeon at load 3-4, a 1B Q4_K layer's four projections:
# 3.33x the blocks' speed at 512 rows, 2.17x at 256, 1.41x at 128, 0.80x at 64). Not without
# AMX: on the 2-core Zen 4 EPYC (AVX-512 BF16, VNNI) the blocks took 0.63x the decode and GEMM's
# time for a 16384 x 2048 Q4_K matrix at 128 rows, 0.76x at 256, 0.78x at 512 (2048 x 8192:
# 0.61x at 128, 0.88x at 512).
DENSE_FROM_ROWS = 128


def blocks_max_rows() -> int:
    """The most rows a call of a :class:`GGMLLinear` with a dense copy computes on the blocks
    here: :data:`GGML_MAX_ROWS` on a CPU with AMX tiles, else :data:`GGML_MAX_ROWS_NO_AMX`
    (torch's cpuid probe; runs nothing)."""
    return GGML_MAX_ROWS if torch.cpu._is_amx_tile_supported() else GGML_MAX_ROWS_NO_AMX


def decodes_wide_calls_here() -> bool:
    """Whether wide calls without a dense copy decode the blocks for the call
    (:data:`DENSE_FROM_ROWS`) on this CPU: where it has AMX tiles (torch's cpuid probe)."""
    return bool(torch.cpu._is_amx_tile_supported())


# The calling thread's buffer of GGMLLinear.decoded (the model thread's, in a server).
_DECODE_BUFFER = threading.local()
# The calling thread's buffer of GGMLLinear.logits (``tensor``; ``enabled`` inside
# logits_in_thread_buffer), and the largest call it serves.
_LOGITS_BUFFER = threading.local()
LOGITS_BUFFER_MAX_BYTES = 256 * 2**20


@contextmanager
def logits_in_thread_buffer() -> Iterator[None]:
    """Within it, the calling thread's LM heads on GGUF blocks write their logits into the
    thread's buffer (:meth:`GGMLLinear.logits`): each step's logits are then valid until the
    thread's next step. For a caller that consumes a step's logits before the next one (the
    runner samples them); anything else gets a tensor of its own per call."""
    before = getattr(_LOGITS_BUFFER, "enabled", False)
    _LOGITS_BUFFER.enabled = True
    try:
        yield
    finally:
        _LOGITS_BUFFER.enabled = before


@dataclass(frozen=True, slots=True)
class GGMLLinear:
    """``y = x @ W.T (+ bias)`` with ``W``'s rows stored as GGUF blocks, in segments (one per
    stacked matrix: a Q4_K_M file's fused QKV holds Q4_K and Q6_K rows).

    Attributes:
        kernels: the loaded library.
        segments: the matrices, in output order.
        in_features: ``K``, a whole number of every segment's blocks.
        bias: ``[out]`` float32, or None.
        wide: a dense projection of the same weights (dequantised, the bias included) for
            calls of more than ``blocks_max_rows`` rows, or None: every call on the blocks.
        blocks_max_rows: with a ``wide`` copy, the most rows a call computes on the blocks.
        dense_from_rows: with no ``wide``, calls of at least this many bfloat16 rows decode
            the blocks to a bfloat16 matrix for the call (0: never; see the module).
        out_dtype: the outputs' dtype on the blocks, or None: the input's. The LM head's is
            float32: its sums are float32 and llama.cpp's logits are too; rounded to bfloat16
            (a step of 0.125 at 16-32), Gemma 3's logits tied where llama.cpp's part by 0.3
            and more. A ``wide`` or decoded call returns its dense product as it comes
            (bfloat16 from a bfloat16 copy): a float32 copy of those values would be exact and
            cost a step a conversion (Gemma 3's head at 64 rows: 16.8 M logits, ~5 ms of a
            ~70 ms step on the AMX Xeon), and the sampler reads either dtype.
        sketch: an LM head's six-bit sketch (:class:`HeadSketch`), which answers
            :meth:`argmax` for one row reading 24% fewer bytes, or None.
    """

    kernels: GGMLKernels
    segments: tuple[QuantSegment, ...]
    in_features: int
    bias: torch.Tensor | None = None
    wide: WideLinear | None = None
    exact_rows: int = EXACT_ROWS_ANY
    prepared: PreparedSegments | None = None
    out_dtype: torch.dtype | None = None
    dense_from_rows: int = 0
    blocks_max_rows: int = GGML_MAX_ROWS
    sketch: HeadSketch | None = None

    def __post_init__(self) -> None:
        if self.prepared is None:  # the call's arguments, built once
            object.__setattr__(self, "prepared", self.kernels.prepare(self.segments))
        if self.wide is not None:
            object.__setattr__(self, "exact_rows", self.blocks_max_rows)
            object.__setattr__(self, "dense_from_rows", 0)
        elif self.dense_from_rows > 0:
            object.__setattr__(self, "exact_rows", self.dense_from_rows - 1)

    @property
    def out_features(self) -> int:
        return sum(segment.rows for segment in self.segments)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks held."""
        return sum(segment.blocks.numel() for segment in self.segments)

    @property
    def tensor_types(self) -> tuple[str, ...]:
        return tuple(segment.tensor_type for segment in self.segments)

    def __call__(self, x: torch.Tensor, *, as_rows: int | None = None) -> torch.Tensor:
        """``x [M, in]`` float32 or bfloat16 -> ``[M, out]`` of ``out_dtype`` (or ``x``'s).
        ``as_rows``: the row count that picks the path (blocks, ``wide``, a decoded matrix),
        when not ``M``: a step's rows without the drafted tokens they verify. A ``wide`` or
        decoded call returns the dense product's dtype whatever ``out_dtype`` says (see the
        attribute; ``project`` widens it where exact rows from the blocks join it)."""
        rows = x.shape[0] if as_rows is None else as_rows
        if self.wide is not None and rows > self.blocks_max_rows:
            return self.wide(x)
        if self._decodes_for(x, rows):
            return F.linear(x, self.decoded(), self._dense_bias())
        return self.kernels.matmul(
            self.prepared, x.contiguous(), bias=self.bias, out_dtype=self.out_dtype
        )

    def logits(self, x: torch.Tensor, *, as_rows: int | None = None) -> torch.Tensor:
        """``self(x, as_rows=as_rows)`` for a step's LM head. Inside
        :func:`logits_in_thread_buffer`, a call on the blocks writes its float32 outputs into
        the calling thread's logits buffer, valid until this thread's next such call. The
        buffer is kept, grown to the largest call of at most :data:`LOGITS_BUFFER_MAX_BYTES`
        (larger calls get a tensor of their own). A fresh tensor per step was a new mapping
        each time (Gemma 3's 64 rows x 262,144 logits are 64 MiB, past what glibc serves from
        a thread's heap): page faults and unmapping took 23% of a sampled 64-row step (perf,
        Zen 5)."""
        rows = x.shape[0] if as_rows is None else as_rows
        size = x.shape[0] * self.out_features
        if (
            not getattr(_LOGITS_BUFFER, "enabled", False)
            or not self._takes_blocks(x, rows)
            or self.out_dtype != torch.float32
            or size * 4 > LOGITS_BUFFER_MAX_BYTES
        ):
            return self(x, as_rows=as_rows)
        out = _thread_buffer(_LOGITS_BUFFER, size, torch.float32)
        return self.kernels.matmul(
            self.prepared,
            x.contiguous(),
            bias=self.bias,
            out_dtype=torch.float32,
            out=out.view(x.shape[0], self.out_features),
        )

    def argmax(self, x: torch.Tensor, *, as_rows: int | None = None) -> torch.Tensor | None:
        """``self(x, as_rows=as_rows).argmax(dim=-1)`` (int64 ``[M]``) computed on the blocks
        without storing the outputs (``GGMLKernels.argmax``: a greedy step's LM head), or None
        where the call would not take the blocks (a ``wide`` copy or a decoded matrix)."""
        rows = x.shape[0] if as_rows is None else as_rows
        if not self._takes_blocks(x, rows):
            return None
        if (self.out_dtype or x.dtype) != torch.float32:  # the argmax of rounded outputs
            return None
        x = x.contiguous()
        if self.sketch is not None and x.shape[0] == 1 and self.bias is None:
            found = self.sketch.argmax(x)  # None: the bounds did not decide
            if found is not None:
                return found[0]
        return self.kernels.argmax(self.prepared, x, bias=self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W.T (+ bias)``, added before the one rounding (on the blocks);
        ``residual`` is not modified."""
        if self.wide is not None and x.shape[0] > self.blocks_max_rows:
            return self.wide.add_to(residual, x)
        if self._decodes_for(x, x.shape[0]) and residual.dtype == x.dtype:
            return residual + F.linear(x, self.decoded(), self._dense_bias())
        return self.kernels.matmul(
            self.prepared, x.contiguous(), bias=self.bias, residual=residual.contiguous()
        )

    def decoded(self) -> torch.Tensor:
        """``W`` as a ``[out, in]`` bfloat16 matrix decoded from the blocks, in the calling
        thread's decode buffer: valid until this thread's next ``decoded()``. One buffer per
        thread, grown to the largest matrix decoded (counted by the load's memory estimate):
        a fresh 64 MiB tensor per call spent more on page faults than on the decode (48.9
        against 19.6 ms for the 1B file's 16384 x 2048 Q4_K matrix)."""
        count = self.out_features * self.in_features
        weight = _thread_buffer(_DECODE_BUFFER, count, torch.bfloat16)
        weight = weight.view(self.out_features, self.in_features)
        start = 0
        for segment in self.segments:
            rows = torch.arange(segment.rows)
            view = weight[start : start + segment.rows]
            self.kernels.dequantize_rows(segment, self.in_features, rows, torch.bfloat16, view)
            start += segment.rows
        return weight

    def _takes_blocks(self, x: torch.Tensor, rows: int) -> bool:
        """Whether a call of ``rows`` rows (``x``'s dtype) computes on the blocks, not on the
        ``wide`` copy or a decoded matrix (``__call__``'s choice)."""
        return not (self.wide is not None and rows > self.blocks_max_rows) and not (
            self._decodes_for(x, rows)
        )

    def _decodes_for(self, x: torch.Tensor, rows: int) -> bool:
        return 0 < self.dense_from_rows <= rows and x.dtype == torch.bfloat16

    def _dense_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(torch.bfloat16)


@dataclass(frozen=True, slots=True)
class GGMLEmbedding:
    """Token lookup in a GGUF matrix's blocks (the tied LM head's own, so the
    ``[vocab, hidden]`` matrix is held once): each row decoded as ``gguf.quants.dequantize``
    decodes it, rounded to ``dtype``."""

    kernels: GGMLKernels
    segment: QuantSegment
    columns: int
    dtype: torch.dtype

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.dequantize_rows(self.segment, self.columns, token_ids, self.dtype)


def _thread_buffer(local: threading.local, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``count`` elements of the calling thread's buffer in ``local``, made (or
    remade larger, or in another dtype) when it does not hold them, and kept."""
    buffer = getattr(local, "tensor", None)
    if buffer is None or buffer.numel() < count or buffer.dtype != dtype:
        local.tensor = buffer = torch.empty(count, dtype=dtype)
    return buffer[:count]
