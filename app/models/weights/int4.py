"""Weight-only 4-bit projections on the CPU from a GGUF's own Q4_0 / Q4_1 codes.

A GGML Q4_1 block holds 32 consecutive weights of a row as 4-bit codes ``q`` in ``0..15`` with
an fp16 scale ``d`` and an fp16 minimum ``m``: ``w = d * q + m``; a Q4_0 block is the same with
``m = -8d`` (:class:`app.models.checkpoints.q4_codes.Q4Codes` holds both). torch's CPU int4 kernel,
``aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_and_zeros)``, computes with
``w = (q - 8) * scale + zero`` per group of ``group_size`` input columns, so the codes go in
unchanged (group size 32) with ``scale = d`` and ``zero = m + 8 * d``.

Not exact in bfloat16. The kernel wants ``scale_and_zeros`` in the dtype of ``x``, and only the
bfloat16 path is vectorised on x86 (AVX512/AVX2): float32 or float16 activations fall back to a
scalar loop, measured 35-65x slower at 1 row (1.4 ms instead of 39 us for a 1536 x 576 matrix).
bfloat16 has 8 significant bits against fp16's 11, so ``d`` and ``m + 8d`` round. The codes are
the file's; only the per-group scale and zero are rounded: ``scale`` is ``d`` to nearest, and
``zero`` the bfloat16 nearest the least-squares zero for that scale (the block's mean of
``w - (q - 8) * scale``). Measured on 8 of the model's matrices, relative RMS difference from
``d * q + m``: 1.8-2.0e-3 (rounding ``m + 8d`` instead: 2.0-2.2e-3; bfloat16 rounding of each
weight, the bfloat16 model: 1.3e-3; the int8 path's re-quantisation: 8-10e-3). Outputs for
random bfloat16 ``x`` against float64 ``x @ W.T``: 2.5-2.7e-3 (the bfloat16 model's 2.1e-3, the
rounding of the output alone 1.6-1.7e-3, int8 8-11e-3). With float32 activations (and float32
scales) the kernel reproduces ``d * q + m`` exactly, at the scalar loop's speed.

How the kernel computes (``aten/src/ATen/native/cpu/int4mm_kernel.cpp``, AVX512): tiles of at
most 4 rows x 64 output columns; each output is a float32 ``fma`` chain over ``k = 0..K-1`` in
order, with each weight dequantised to float32 as ``fma(q - 8, scale, zero)``, and rounded to
bfloat16 once at the end. A row's result does not depend on the other rows of the call nor on
the thread count: the int4 path is batch-invariant (tested for 1..``INT4_MAX_ROWS`` rows). It is
a GEMV at heart (every 4 rows dequantise the weights again), so above ``INT4_MAX_ROWS`` rows a
bfloat16 projection (:attr:`Int4Linear.wide`) of the Q4_1 weights ``d * q + m`` rounded to
bfloat16 is used. The two paths differ by ~3e-3 relative (half the outputs differ by an ulp or
more): rows are batch-invariant up to ``INT4_MAX_ROWS`` rows, not across it. ``wide`` rounds the
exact weights rather than the kernel's (which would make the two paths only slightly closer,
2.6e-3 instead of 3.1e-3, and ``wide`` less accurate: 2.9e-3 from ``x @ W.T`` instead of 2.1e-3).

RMSNorm weights cannot be folded into the input columns of an int4 matrix (a per-column factor
breaks the shared scale of each 32-column group), so a model using :class:`Int4Linear` must apply
``attn_norm``/``ffn_norm`` to the activations.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from app.models.checkpoints.q4_codes import Q4_BLOCK, Q4Codes
from app.models.weights.projections import LinearKernel, WideLinear, dense_projection

# Rows up to which the int4 kernel is used; above, ``Int4Linear.wide`` (bfloat16). The kernel
# works in blocks of 4 rows and dequantises the weights again for each block, so 5 rows cost
# about what 8 do. Measured with scripts/bench_int4.py (all 120 projections of a step, 2-core
# AVX512/AMX CPU, median of interleaved rounds), int4 / packed bfloat16 (oneDNN): 2 threads
# 0.29x at 1 row, 0.36x at 2, 0.50x at 4, 0.96x at 5, 0.89x at 8; 1 thread 0.28x, 0.33x, 0.47x,
# 0.71x, 0.90x (other runs under load: 1.1-1.4x at 5-8 rows); at 16 rows 2.4x.
INT4_MAX_ROWS = 4

# Input columns per (scale, zero) pair: one Q4_1 block.
INT4_GROUP_SIZE = Q4_BLOCK

# ``_convert_weight_to_int4pack_for_cpu``'s ``innerKTiles``: ignored by the CPU packing (the
# packed tensor is the same for 1, 2, 4 and 8); 2 keeps its ``K % (16 * tiles)`` check at 32.
_INNER_K_TILES = 2


def int4_kernel_status() -> tuple[bool, str]:
    """Whether torch's CPU int4 kernel runs here and computes ``(q - 8) * scale + zero``.

    Returns (available, reason): a tiny matrix with known codes is multiplied by one-hot rows and
    its weights compared with the formula.
    """
    ops = torch.ops.aten
    if not (
        hasattr(ops, "_weight_int4pack_mm_for_cpu")
        and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")
    ):
        return False, "torch has no _weight_int4pack_mm_for_cpu"
    try:
        codes = (torch.arange(16 * 64, dtype=torch.int32).reshape(16, 64) * 7) % 16
        scale = torch.full((16, 2), 0.5, dtype=torch.bfloat16)
        zero = torch.full((16, 2), 0.25, dtype=torch.bfloat16)
        layer = _Int4Kernel.pack(codes, scale, zero)
        weight_t = layer(torch.eye(64, dtype=torch.bfloat16)).float()  # [in, out] = W.T
        expected = (codes.float() - 8) * 0.5 + 0.25
        if not torch.equal(weight_t.t(), expected):
            return False, "_weight_int4pack_mm_for_cpu gave a wrong probe result"
    except RuntimeError as error:
        return False, f"_weight_int4pack_mm_for_cpu unavailable ({error})"
    return True, "torch CPU int4 kernel (bfloat16 activations)"


def q4_1_scale_and_zero(
    codes: np.ndarray, d: np.ndarray, m: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """bfloat16 ``(scale, zero)``, each ``[out, in / 32]``, for the int4 kernel's
    ``(q - 8) * scale + zero`` to approximate Q4_1's ``d * q + m`` with the same codes.

    ``scale`` is ``d`` rounded to bfloat16; ``zero`` the bfloat16 nearest the least-squares zero
    for that scale: ``mean over the block of (d * q + m - (q - 8) * scale)``, computed in float64.

    Args:
        codes: uint8 ``[out, in]`` in ``0..15``.
        d, m: float32 ``[out, in / 32]``.
    """
    out_features = codes.shape[0]
    mean_code = codes.reshape(out_features, -1, Q4_BLOCK).mean(axis=-1, dtype=np.float64)
    scale = torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32)).to(torch.bfloat16)
    exact_mean = d.astype(np.float64) * mean_code + m.astype(np.float64)
    zero = exact_mean - scale.double().numpy() * (mean_code - 8.0)
    return scale, torch.from_numpy(zero).to(torch.bfloat16)


def int4_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The weights the int4 kernel computes with: float32 ``[out, in]``, ``(q - 8) * scale +
    zero`` per group of 32 columns. Bit for bit those of the AVX512 kernel for bfloat16 scales
    (``(q - 8) * scale`` is then exact in float32, so one rounding, as the kernel's ``fma``); the
    AVX2 kernel computes ``q * scale + (zero - 8 * scale)``, which may differ in the last bit.

    Args:
        codes: ``[out, in]`` integers in ``0..15`` (any integer dtype).
        scale, zero: ``[out, in / 32]``, any float dtype (bfloat16 for the kernel's).
    """
    out_features, in_features = codes.shape
    centred = (codes.to(torch.float32) - 8.0).view(out_features, -1, INT4_GROUP_SIZE)
    weight = centred * scale.float()[:, :, None] + zero.float()[:, :, None]
    return weight.view(out_features, in_features)


@functools.cache
def _int4_mm() -> torch._ops.OpOverload:
    return torch.ops.aten._weight_int4pack_mm_for_cpu.default


@dataclass(frozen=True, slots=True)
class _Int4Kernel:
    """One ``aten._weight_int4pack_mm_for_cpu`` weight: ``x [M, in]`` bfloat16, contiguous ->
    ``[M, out]`` bfloat16.

    Attributes:
        packed: uint8 ``[out, in / 2]``, the kernel's layout (codes of 64 output columns
            interleaved per input column on AVX512).
        scale_and_zeros: bfloat16 ``[in / 32, out, 2]``: ``[..., 0]`` the scales, ``[..., 1]``
            the zeros.
    """

    packed: torch.Tensor
    scale_and_zeros: torch.Tensor

    @classmethod
    def pack(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> _Int4Kernel:
        """From int32 ``codes [out, in]`` (0..15) and bfloat16 ``scale``/``zero [out, in/32]``."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), _INNER_K_TILES
        )
        scale_and_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
        return cls(packed, scale_and_zeros.to(torch.bfloat16))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The op's overload itself: calling through ``torch.ops.aten.<op>`` resolves it on
        # every call (~2 us of a ~23 us one-row call; 120 calls a step).
        return _int4_mm()(x.contiguous(), self.packed, INT4_GROUP_SIZE, self.scale_and_zeros)


@dataclass(frozen=True, slots=True)
class Int4Linear:
    """Weight-only int4 with a GGUF's Q4_0/Q4_1 codes: ``y = x @ W.T + bias`` for ``W [out,
    in]``, the file's 4-bit weights (up to bfloat16 rounding of their scales, see the module
    docstring).

    ``x [M, in]`` bfloat16 with ``M <= INT4_MAX_ROWS`` goes through the int4 kernel (``int4``);
    larger ``M`` through ``wide``, a bfloat16 projection of the exact 4-bit weights ``d * q +
    m`` rounded to bfloat16 (see the module docstring for how the two differ). CPU only. Memory
    for SmolLM2's 30 layers: 50.6 MiB of int4 codes, 12.7 MiB of scales and zeros, plus
    ``wide``'s bfloat16 copy (202.5 MiB).
    """

    int4: _Int4Kernel
    wide: WideLinear
    bias: torch.Tensor | None = None  # bfloat16 [out]
    # Rows that must be batch-invariant always take the int4 kernel, in calls of at most this
    # many rows (a row's result there does not depend on the call: tested for 1..64 rows).
    exact_rows = INT4_MAX_ROWS

    @classmethod
    def from_codes(
        cls,
        parts: Q4Codes | Sequence[Q4Codes],
        *,
        kernel: LinearKernel = LinearKernel.DENSE,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """Build from 4-bit matrices (:meth:`app.models.checkpoints.gguf_file.GGUFFile.q4_codes`),
        concatenated along the output dimension in order (fused QKV: q, k, v; gate/up: gate,
        up). ``kernel`` is how ``wide`` computes; ``bias`` is bfloat16 ``[out]`` or None.

        Raises:
            ValueError: ``out`` is not a multiple of 16, ``in`` not of 32, or shapes disagree.
        """
        parts = [parts] if isinstance(parts, Q4Codes) else list(parts)
        codes = _concatenate([p.codes for p in parts])
        d = _concatenate([p.d for p in parts])
        m = _concatenate([p.m for p in parts])
        out_features, in_features = codes.shape
        groups = (out_features, in_features // INT4_GROUP_SIZE)
        if in_features % INT4_GROUP_SIZE or d.shape != groups or m.shape != groups:
            raise ValueError(
                f"codes {codes.shape} with d {d.shape}, m {m.shape}: expected groups of "
                f"{INT4_GROUP_SIZE} input columns"
            )
        if out_features % 16:
            raise ValueError(f"the int4 kernel needs out_features % 16 == 0, got {out_features}")
        scale, zero = q4_1_scale_and_zero(codes, d, m)
        exact = Q4Codes(codes, d, m).dequantize()  # float32 [out, in]
        weight = torch.from_numpy(exact).to(torch.bfloat16)
        int4 = _Int4Kernel.pack(torch.from_numpy(codes), scale, zero)
        return cls(int4, dense_projection(weight, kernel, bias), bias)

    @property
    def out_features(self) -> int:
        return self.int4.scale_and_zeros.shape[1]

    @property
    def in_features(self) -> int:
        return self.int4.scale_and_zeros.shape[0] * INT4_GROUP_SIZE

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, in]`` bfloat16 -> ``[M, out]`` bfloat16."""
        if x.shape[0] <= INT4_MAX_ROWS:
            out = self.int4(x)
            return out if self.bias is None else out.add_(self.bias)
        return self.wide(x)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W.T`` (bfloat16 ``[M, out]``); ``residual`` is not modified."""
        if x.shape[0] <= INT4_MAX_ROWS:
            return self(x).add_(residual)
        return self.wide.add_to(residual, x)


def _concatenate(parts: Sequence[np.ndarray]) -> np.ndarray:
    if len(parts) == 1:
        return np.ascontiguousarray(parts[0])
    return np.ascontiguousarray(np.concatenate(list(parts), axis=0))
