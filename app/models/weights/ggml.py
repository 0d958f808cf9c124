"""Projections and token lookups that compute on a GGUF file's own blocks (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), through :mod:`app.models.kernels.ggml_quant`.

The blocks are the file's memory-mapped bytes (a copy only where llama.cpp's permuted Q/K rows
need Hugging Face's order), and no dense copy of a quantised weight is made: a model's resident
weights are the file's bytes. The RMSNorm weights cannot be folded into the
input columns (a block's scale is shared by 32 or 256 columns), so a model using
:class:`GGMLLinear` applies ``attn_norm`` / ``ffn_norm`` to the activations, as with int4.

Every row of a call is computed alone (see the kernels' module): ``exact_rows`` is unbounded.

A model may also keep a dense copy for wide steps (``wide``; ``--wide-copies``, by default only
where the copies come to at most 512 MiB: memory at the file's size is the point for real-sized
files): the block kernels are a GEMV at heart, and from
``GGML_MAX_ROWS + 1`` rows on oneDNN's GEMM over dense weights is faster (measured on SmolLM2,
2-core AVX-512 EPYC: a step's projections 7.1 against 9.6 ms at 1 row, equal at 2 and 4, 18.4
against 10.3 at 8, 41 against 15.5 at 16). Then a row is batch-invariant up to
``GGML_MAX_ROWS`` rows a call, as with int4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.models.kernels.ggml_quant import GGMLKernels, PreparedSegments, QuantSegment
from app.models.weights.projections import WideLinear

# Any number of rows per call computes each row as it would alone.
EXACT_ROWS_ANY = 2**31 - 1
# With a wide copy: calls of up to this many rows take the block kernels, larger ones the copy.
GGML_MAX_ROWS = 4


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
            calls of more than ``GGML_MAX_ROWS`` rows, or None: every call on the blocks.
        out_dtype: the outputs' dtype, or None: the input's. The LM head's is float32: its
            sums are float32 and llama.cpp's logits are too; rounded to bfloat16 (a step of
            0.125 at 16-32), Gemma 3's logits tied where llama.cpp's part by 0.3 and more.
    """

    kernels: GGMLKernels
    segments: tuple[QuantSegment, ...]
    in_features: int
    bias: torch.Tensor | None = None
    wide: WideLinear | None = None
    exact_rows: int = EXACT_ROWS_ANY
    prepared: PreparedSegments | None = None
    out_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.prepared is None:  # the call's arguments, built once
            object.__setattr__(self, "prepared", self.kernels.prepare(self.segments))
        if self.wide is not None:
            object.__setattr__(self, "exact_rows", GGML_MAX_ROWS)

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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, in]`` float32 or bfloat16 -> ``[M, out]`` of ``out_dtype`` (or ``x``'s)."""
        if self.wide is not None and x.shape[0] > GGML_MAX_ROWS:
            y = self.wide(x)
            return y if self.out_dtype is None else y.to(self.out_dtype)
        return self.kernels.matmul(
            self.prepared, x.contiguous(), bias=self.bias, out_dtype=self.out_dtype
        )

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W.T (+ bias)``, added before the one rounding; ``residual`` is not
        modified."""
        if self.wide is not None and x.shape[0] > GGML_MAX_ROWS:
            return self.wide.add_to(residual, x)
        return self.kernels.matmul(
            self.prepared, x.contiguous(), bias=self.bias, residual=residual.contiguous()
        )


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
