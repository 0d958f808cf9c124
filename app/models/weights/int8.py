"""Weight-only int8 projections (``--quantization int8``) and the token lookup that reads them.

``weight ~= qweight * scales[:, None]``: symmetric, one scale per output row, re-quantised at
load from the file's float weights. Steps of at most ``INT8_MAX_ROWS`` rows go through
``aten._weight_int8pack_mm`` (bfloat16 activations, one byte per weight read once per step);
larger steps through a bfloat16 projection of the same int8 values times the same scales: the
int8 kernel is a GEMV at heart and loses to bfloat16 GEMM from 2-4 rows on
(docs/MODEL_PERF.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.models.weights.projections import LinearKernel, WideLinear, dense_projection

INT8_MAX_ROWS = 2


@dataclass(frozen=True, slots=True)
class Int8Linear:
    """Weight-only int8: ``weight ~= qweight * scales[:, None]`` (symmetric, per output row).

    ``x [M, in]`` with ``M <= INT8_MAX_ROWS`` goes through ``aten._weight_int8pack_mm``
    (bfloat16 activations); larger ``M`` through ``wide``, a bfloat16 projection of the same
    int8 values times the same scales, so every path computes with the same weights (up to
    bfloat16 rounding of their products) and only the kernel changes with the batch size.
    (Power-of-two scales would make those products exact, but they cost accuracy: greedy
    agreement with float32 93.2% instead of 95.6%; and a bfloat16 model is not batch-invariant
    anyway, see docs/MODEL_PERF.md.)
    """

    qweight: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out], model dtype
    wide: WideLinear
    bias: torch.Tensor | None = None  # [out], model dtype
    # The int8 kernel computes a row the same in calls of 1..8 rows (measured), so rows that
    # must be batch-invariant always take it, in calls of at most INT8_MAX_ROWS.
    exact_rows = INT8_MAX_ROWS

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        dtype: torch.dtype,
        kernel: LinearKernel = LinearKernel.DENSE,
        bias: torch.Tensor | None = None,
    ) -> Int8Linear:
        """Quantise a float32 ``weight [out, in]``; scales are rounded to ``dtype`` first.
        ``bias``: ``[out]`` in ``dtype``, or None."""
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(dtype)
        qweight = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        dequantized = (qweight.float() * scales.float()[:, None]).to(dtype)
        wide = dense_projection(dequantized, kernel, bias)
        return cls(qweight.contiguous(), scales.contiguous(), wide, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT8_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
            return out if self.bias is None else out.add_(self.bias)
        return self.wide(x)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T``; ``residual`` is not modified."""
        if x.shape[0] <= INT8_MAX_ROWS:
            return self(x).add_(residual)
        return self.wide.add_to(residual, x)


@dataclass(frozen=True, slots=True)
class Int8Embedding:
    """Token lookup in an int8 LM head tied to the embedding: ``qweight[id] * scales[id]``, so
    an int8 model keeps no second copy of the ``[vocab, hidden]`` matrix."""

    qweight: torch.Tensor  # int8 [vocab, hidden]
    scales: torch.Tensor  # [vocab], model dtype

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(token_ids, self.qweight).to(self.scales.dtype)
        return rows.mul_(self.scales[token_ids, None])
