"""Matmuls and token lookups on a GGUF file's own quantised blocks (llama.cpp's formats), in C
built at first use (:mod:`app.models.kernels.build`) and called through :mod:`ctypes`.

The C source is split by job: ``ggml_quant.h`` (the contract: block layouts, the per-format
function table), ``ggml_quant_legacy.c`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 against 8-bit
activation blocks of 32), ``ggml_quant_kquants.c`` (Q4_K, Q5_K, Q6_K against 8-bit activation
blocks of 256 with their 16-value sums), the tile kernels ``ggml_quant_tiles.c`` (32-weight
formats) and ``ggml_quant_ktiles.c`` (K formats), and ``ggml_quant_matmul.c`` (activation
quantisation, the split over threads, bias, residual, rounding).

How: the activations of a call are quantised once to 8-bit blocks with one float32 scale each
(the scheme llama.cpp's CPU backend uses for its Q8_0 / Q8_K dot products), then every output
is the integer dot product of one weight row's codes with one activation row's codes, scaled
per block, accumulated in float32. One function per (format, instruction set) computes it and
never looks at another row, so a row's result is the same in any batch and on any thread: the
projections are batch-invariant at any row count (tested).

On AVX2 and AVX-512 VNNI every format runs on tile kernels: eight weight rows per vector,
decoded once per tile into an interleaved copy for calls of many rows (one activation row per
4 codes x 8 rows per ``vpmaddubsw``, or per ``vpdpbusd`` with VNNI), read straight from the
file's rows for few (the 32-weight formats: one row; the K formats: up to eight, each
super-block unpacked once for four rows at a time); all of these produce the same integers and
share one float sequence per format, so batch invariance holds across the switch, and the two
instruction sets give the same bits. Measured, a SmolLM2 layer's four Q4_1 projections, one
thread: 1.85x the one-row code at 64 rows, 1.7x at 16, equal at 1 (AVX2 EPYC); 3.1x the
AVX-512 one-row dots at 64 rows, 2.4x at 16, 1.1x at 1 (AMX Xeon). A 1B Q4_K layer (Q6_K
down), two threads on the AMX Xeon, against the K formats' former one-row dots (4 rows per
unpack): 1.6-1.8x at 32-64 rows, 1.4x at 16, 1.2x at 1-8 with VNNI; 1.3-1.4x at 16-64 forced
to AVX2 (docs/MODEL_PERF.md).

A load with a block arena repacks Q4_0-Q8_0 and Q4_K matrices into rows interleaved eight at a
time (:meth:`GGMLKernels.repack8`, ``QuantSegment.interleaved``; the layout in ``ggml_quant.h``):
then a call of a few rows reads each group of eight rows as one stream of lane-ordered codes
and scales, and the tiles are decoded from it without a transpose. The same outputs, bit for
bit, and the same bytes.

Instruction sets are chosen at run time from cpuid (``__builtin_cpu_supports``), not by the
build: scalar C, AVX2 (``vpmaddubsw``), AVX-512 VNNI (``vpdpbusd``). ``SLOTSERVE_GGML_ISA``
(``scalar``, ``avx2``, ``avx512``) forces one the CPU has, for tests and benchmarks.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from app.models.kernels.build import KernelBuildError, build_library, torch_libgomp
from app.models.kernels.ggml_quant_cpu import (
    Isa,
    best_isa,
    call_arguments,
    check_status,
    declare,
    prefetch_level,
)

SOURCE_DIR = Path(__file__).parent
# SL_AMX_MIN_ROWS in ggml_quant_matmul.c: calls of this many activation rows or more take the
# AMX-INT8 tiles where the CPU has them (SLOTSERVE_GGML_AMX=0 turns them off).
AMX_MIN_ROWS = 12
# Every file of the library's source; the cache key hashes them all.
SOURCES = (
    "ggml_quant.h",
    "ggml_quant_avx2.h",
    "ggml_quant_legacy.c",
    "ggml_quant_kquants.c",
    "ggml_quant_matmul.c",
    "ggml_quant_tiles.c",
    "ggml_quant_amx.c",
    "ggml_quant_tiles_body.h",
    "ggml_quant_tiles16.h",
    "ggml_quant_ktiles.c",
    "ggml_quant_ktiles_body.h",
    "ggml_quant_ktiles16.h",
    "ggml_quant_rows.c",
    "ggml_quant_cpu.c",
    "ggml_quant_dispatch.h",
    "ggml_quant_ktiles_x8_body.h",
    "ggml_quant_sketch.c",
)
# No -march: each SIMD function carries its own target attribute and is picked by cpuid.
CFLAGS: tuple[str, ...] = ()

# GGUF tensor types computed on their blocks, by name -> ggml's type id (enum ggml_type).
KERNEL_TYPES = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
}


# SL_X8: a qtype's flag for rows repacked eight at a time at load (ggml_quant.h, "x8"): the
# 32-weight formats and Q4_K, whose gemv then reads one stream with no horizontal sums or scale
# inserts (1.45x its speed on SmolLM2's Q4_1 projections from L3, one thread, AMX Xeon).
X8 = 0x100
# (bytes, weights) of a block, per type with that layout
_BLOCKS = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q8_0": (34, 32),
    "Q4_K": (144, 256),
}
INTERLEAVED_TYPES = frozenset(_BLOCKS)


@dataclass(frozen=True, slots=True)
class QuantSegment:
    """One weight matrix in its file's blocks: ``blocks`` uint8 ``[rows, row_bytes]`` (CPU,
    contiguous), ``tensor_type`` one of :data:`KERNEL_TYPES`; ``interleaved``: the blocks were
    repacked by :meth:`GGMLKernels.repack8` (each full group of eight rows interleaved, the
    same bytes in another order), else the file's layout."""

    tensor_type: str
    blocks: torch.Tensor
    interleaved: bool = False

    @property
    def qtype(self) -> int:
        """The type id the kernels take: ggml's, with :data:`X8` for interleaved blocks."""
        return KERNEL_TYPES[self.tensor_type] | (X8 if self.interleaved else 0)

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]


@dataclass(frozen=True, slots=True)
class PreparedSegments:
    """:meth:`GGMLKernels.prepare`'s result: the segments and their ctypes call arguments
    (they keep the segments, so the pointers stay valid)."""

    segments: tuple[QuantSegment, ...]
    qtypes: ctypes.Array
    pointers: ctypes.Array
    seg_rows: ctypes.Array
    out_features: int


@dataclass(frozen=True, slots=True)
class GGMLKernels:
    """The loaded library and the instruction set its calls use."""

    library: ctypes.CDLL
    path: Path
    isa: Isa
    threaded: bool
    repack: bool = True  # interleave INTERLEAVED_TYPES' rows at load (SLOTSERVE_GGML_REPACK)

    def row_bytes(self, tensor_type: str, columns: int) -> int:
        """Bytes of one row of ``columns`` weights in ``tensor_type``.

        Raises:
            ValueError: the type is not computed here or ``columns`` is not whole blocks.
        """
        size = (
            -1
            if tensor_type not in KERNEL_TYPES
            else self.library.sl_quant_row_bytes(KERNEL_TYPES[tensor_type], columns)
        )
        if size < 0:
            raise ValueError(f"{tensor_type} rows of {columns} weights are not computed here")
        return size

    def prepare(self, segments: tuple[QuantSegment, ...]) -> PreparedSegments:
        """The call arguments of ``segments`` built once (a projection calls with the same
        weights every step: building them per call cost more than a small matrix's product).

        Raises:
            ValueError: a segment's type is not computed here.
        """
        unknown = [s.tensor_type for s in segments if s.tensor_type not in KERNEL_TYPES]
        if unknown:
            raise ValueError(f"types {unknown} are not computed by the GGUF-block kernels")
        count = len(segments)
        return PreparedSegments(
            segments,
            (ctypes.c_int32 * count)(*(s.qtype for s in segments)),
            (ctypes.c_void_p * count)(*(s.blocks.data_ptr() for s in segments)),
            (ctypes.c_int64 * count)(*(s.rows for s in segments)),
            sum(s.rows for s in segments),
        )

    def matmul(
        self,
        segments: tuple[QuantSegment, ...] | PreparedSegments,
        x: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        isa: Isa | None = None,
        out_dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x @ W.T (+ bias) (+ residual)`` where ``W``'s rows are the segments' rows in order.

        Args:
            segments: the matrices, or their :meth:`prepare` d call arguments.
            x: ``[M, K]`` float32 or bfloat16, rows contiguous (CPU).
            bias: ``[N]`` float32, or None.
            residual: ``[M, N]`` of the result's dtype, rows contiguous, or None; not modified.
            isa: the instruction set (default: the loaded one); must be one the CPU has.
            out_dtype: float32 or bfloat16, the result's dtype (None: ``x``'s). The sums are
                float32 either way: a float32 result of bfloat16 rows is not rounded at all
                (the LM head's logits, as llama.cpp's are float32).
            out: a contiguous ``[M, N]`` of ``out_dtype`` to write into, or None: a new one.

        Returns:
            ``[M, N]``; a bfloat16 result is rounded once, after the adds.

        Raises:
            ValueError: a dtype, layout or width the kernels do not take.
        """
        prepared = segments if isinstance(segments, PreparedSegments) else self.prepare(segments)
        rows = x.shape[0]
        n = prepared.out_features
        out_dtype = x.dtype if out_dtype is None else out_dtype
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
        out = torch.empty((rows, n), dtype=out_dtype) if out is None else out
        if out.shape != (rows, n) or out.dtype != out_dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {out_dtype} [{rows}, {n}] tensor")
        if residual is not None and (residual.dtype != out_dtype or residual.stride(1) != 1):
            raise ValueError("residual must be rows of the result's dtype")
        arguments = call_arguments(self.isa if isa is None else isa, prepared, x, bias)
        if rows == 0:
            return out if residual is None else out.copy_(residual)
        status = self.library.sl_quant_matmul(
            *arguments,
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            out.data_ptr(),
            int(out_dtype == torch.bfloat16),
            n,
            None,  # the calling thread's own scratch buffer
            torch.get_num_threads(),
        )
        check_status(status, prepared, x.shape[1])
        return out

    def argmax(
        self,
        segments: tuple[QuantSegment, ...] | PreparedSegments,
        x: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        isa: Isa | None = None,
    ) -> torch.Tensor:
        """``(x @ W.T (+ bias)).argmax(dim=-1)`` of :meth:`matmul`'s float32 result, without
        storing it: int64 ``[M]``, torch's index (the first of equal values, a NaN the
        largest). A greedy step's LM head (Gemma 3's 16 rows x 262,144 logits, 16 MiB that
        were written and read back: the step 4% shorter on the AMX Xeon, docs/MODEL_PERF.md).

        Raises:
            ValueError / MemoryError: as :meth:`matmul`.
        """
        prepared = segments if isinstance(segments, PreparedSegments) else self.prepare(segments)
        arguments = call_arguments(self.isa if isa is None else isa, prepared, x, bias)
        index = torch.zeros(x.shape[0], dtype=torch.int64)
        if x.shape[0]:
            status = self.library.sl_quant_argmax(
                *arguments, index.data_ptr(), torch.get_num_threads()
            )
            check_status(status, prepared, x.shape[1])
        return index

    def dequantize_rows(
        self,
        segment: QuantSegment,
        columns: int,
        ids: torch.Tensor,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[n]``) of ``segment`` decoded to ``[n, columns]`` of ``dtype``
        (float32 or bfloat16, rounded once from the float32 decode); from 64 rows on, over
        torch's threads. ``out``: a contiguous ``[n, columns]`` tensor of ``dtype`` to write
        them into (returned), or None: a new one.

        Raises:
            ValueError: another dtype, or a type the kernels do not decode, or an ``out`` of
                another shape, dtype or layout.
        """
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"rows decode to float32 or bfloat16, not {dtype}")
        shape = (ids.shape[0], columns)
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.shape != shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"out must be contiguous {dtype} {shape}")
        ids = ids.to(torch.int64).contiguous()
        status = self.library.sl_quant_dequantize_rows(
            segment.qtype,
            segment.blocks.data_ptr(),
            segment.rows,
            columns,
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
            int(dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"{segment.tensor_type} rows of {columns} are not decoded here (or an id is "
                f"outside its {segment.rows} rows)"
            )
        return out

    def interleaves(self, tensor_type: str, rows: int) -> bool:
        """Whether a load repacks a matrix of ``rows`` rows in ``tensor_type`` (one of
        :data:`INTERLEAVED_TYPES`, at least one group of eight rows, SIMD kernels, and
        :attr:`repack` on)."""
        return (
            self.repack and self.isa >= Isa.AVX2 and tensor_type in INTERLEAVED_TYPES and rows >= 8
        )

    def repack8(self, tensor_type: str, blocks: np.ndarray, out: np.ndarray) -> None:
        """``blocks`` (uint8 ``[rows, row_bytes]`` in the file's layout, C-contiguous) written
        into ``out`` (the same shape, not overlapping) with each full group of eight rows
        interleaved (ggml_quant.h, "x8"); the rows after the last full group as they are. A
        matrix repacked in parts of whole groups is the same as repacked at once.

        Raises:
            ValueError: not a type with that layout, or shapes that do not fit.
        """
        rows, row_bytes = blocks.shape
        block_bytes, block_weights = _BLOCKS.get(tensor_type, (row_bytes + 1, 0))
        columns = row_bytes // block_bytes * block_weights  # 0: refused
        if (
            out.shape != blocks.shape
            or not (blocks.flags.c_contiguous and out.flags.c_contiguous)
            or tensor_type not in INTERLEAVED_TYPES
            or self.library.sl_quant_repack8(
                KERNEL_TYPES[tensor_type], blocks.ctypes.data, out.ctypes.data, rows, columns
            )
            != 0
        ):
            raise ValueError(f"{tensor_type} blocks {blocks.shape} are not repacked here")

    def supports(self, isa: Isa) -> bool:
        """Whether this CPU runs ``isa`` (cpuid, and the OS saves its registers)."""
        return bool(self.library.sl_quant_isa_supported(int(isa)))

    @property
    def tiles_taken_over(self) -> int:
        """Tiles of 16 weight rows that a thread took over from another's run (calls of 2
        activation rows or more), since the library loaded."""
        return int(self.library.sl_quant_tiles_taken_over())

    @property
    def amx(self) -> bool:
        """Whether calls on :attr:`Isa.AVX512` of ``AMX_MIN_ROWS`` rows or more take the
        AMX-INT8 tiles (the 32-weight formats): the CPU has AMX-INT8, the OS granted the tile
        state, ``SLOTSERVE_GGML_AMX`` is not 0."""
        return bool(self.library.sl_quant_amx_ready())


@functools.cache
def load_ggml_quant() -> tuple[GGMLKernels | None, str]:
    """Build (once per machine, cached on disk) and load the kernels.

    Returns ``(kernels, how)``: the kernels, or None and the reason they are not available
    (no C compiler, a build error, a forced instruction set the CPU lacks); ``how`` goes into
    the start-up log and ``/info``. Never raises.
    """
    try:
        library, target, threaded = build_library("ggml_quant", SOURCE_DIR, SOURCES, CFLAGS)
        declare(library)
        isa, why = best_isa(library)
        why += f", {prefetch_level(library)}"
    except KernelBuildError as error:
        return None, str(error)
    except AttributeError as error:  # a library without the functions declared
        return None, f"build or load failed: {error}"
    repack = os.environ.get("SLOTSERVE_GGML_REPACK", "1").strip() != "0"
    if isa >= Isa.AVX2:
        why += (
            ", Q4_0-Q8_0 and Q4_K rows interleaved 8 at a time at load"
            if repack
            else ", rows in the file's layout (SLOTSERVE_GGML_REPACK=0)"
        )
    threads = f"torch's OpenMP threads ({torch_libgomp()})" if threaded else "one thread"
    # asked once here, before any thread computes: the kernel grants the tile state then
    if isa == Isa.AVX512 and library.sl_quant_amx_ready():
        why += f", AMX-INT8 tiles from {AMX_MIN_ROWS} rows (32-weight formats; 16 interleaved)"
    kernels = GGMLKernels(library, target, isa, threaded, repack)
    return kernels, f"GGUF-block kernels: {why}; {threads}"
