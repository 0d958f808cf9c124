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

Instruction sets are chosen at run time from cpuid (``__builtin_cpu_supports``), not by the
build: scalar C, AVX2 (``vpmaddubsw``), AVX-512 VNNI (``vpdpbusd``). ``SLOTSERVE_GGML_ISA``
(``scalar``, ``avx2``, ``avx512``) forces one the CPU has, for tests and benchmarks.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch

from app.models.kernels.build import KernelBuildError, build_library, torch_libgomp

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
    "ggml_quant_ktiles.c",
    "ggml_quant_ktiles_body.h",
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


class Isa(IntEnum):
    """The instruction sets of the kernels (``enum sl_isa``), worst to best."""

    SCALAR = 0
    AVX2 = 1
    AVX512 = 2

    @property
    def describe(self) -> str:
        return {
            Isa.SCALAR: "scalar C",
            Isa.AVX2: "AVX2 maddubs",
            Isa.AVX512: "AVX-512 VNNI dpbusd",
        }[self]


_c_void_p, _c_int, _c_int64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class QuantSegment:
    """One weight matrix in its file's blocks: ``blocks`` uint8 ``[rows, row_bytes]`` (CPU,
    contiguous), ``tensor_type`` one of :data:`KERNEL_TYPES`."""

    tensor_type: str
    blocks: torch.Tensor

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
            (ctypes.c_int32 * count)(*(KERNEL_TYPES[s.tensor_type] for s in segments)),
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

        Returns:
            ``[M, N]``; a bfloat16 result is rounded once, after the adds.

        Raises:
            ValueError: a dtype, layout or width the kernels do not take.
        """
        prepared = segments if isinstance(segments, PreparedSegments) else self.prepare(segments)
        rows, columns = x.shape
        if x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1:
            raise ValueError(f"x must be float32 or bfloat16 rows, got {x.dtype} {x.stride()}")
        n = prepared.out_features
        out_dtype = x.dtype if out_dtype is None else out_dtype
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
        out = torch.empty((rows, n), dtype=out_dtype)
        if rows == 0:
            return out if residual is None else out.copy_(residual)
        if residual is not None and (residual.dtype != out_dtype or residual.stride(1) != 1):
            raise ValueError("residual must be rows of the result's dtype")
        bf16 = int(x.dtype == torch.bfloat16)
        status = self.library.sl_quant_matmul(
            int(self.isa if isa is None else isa),
            len(prepared.segments),
            prepared.qtypes,
            prepared.pointers,
            prepared.seg_rows,
            columns,
            x.data_ptr(),
            bf16,
            rows,
            x.stride(0),
            None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            out.data_ptr(),
            int(out_dtype == torch.bfloat16),
            n,
            None,  # the calling thread's own scratch buffer
            torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError("no memory for the quantised activations")
        if status != 0:
            kinds = [s.tensor_type for s in prepared.segments]
            raise ValueError(f"segments {kinds} of width {columns}")
        return out

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
            KERNEL_TYPES[segment.tensor_type],
            segment.blocks.data_ptr(),
            columns,
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
            int(dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"{segment.tensor_type} rows of {columns} are not decoded here")
        return out

    def supports(self, isa: Isa) -> bool:
        """Whether this CPU runs ``isa`` (cpuid, and the OS saves its registers)."""
        return bool(self.library.sl_quant_isa_supported(int(isa)))

    @property
    def amx(self) -> bool:
        """Whether calls on :attr:`Isa.AVX512` of ``AMX_MIN_ROWS`` rows or more take the
        AMX-INT8 tiles (the 32-weight formats): the CPU has AMX-INT8, the OS granted the tile
        state, ``SLOTSERVE_GGML_AMX`` is not 0."""
        return bool(self.library.sl_quant_amx_ready())


def _declare(library: ctypes.CDLL) -> None:
    library.sl_quant_isa_supported.argtypes = [_c_int]
    library.sl_quant_isa_supported.restype = _c_int
    library.sl_quant_amx_ready.argtypes = []
    library.sl_quant_amx_ready.restype = _c_int
    library.sl_quant_set_prefetch_l2.argtypes = [_c_int]
    library.sl_quant_set_prefetch_l2.restype = None
    library.sl_quant_cpu_is_intel.argtypes = []
    library.sl_quant_cpu_is_intel.restype = _c_int
    library.sl_quant_row_bytes.argtypes = [_c_int, _c_int64]
    library.sl_quant_row_bytes.restype = _c_int64
    library.sl_quant_scratch_bytes.argtypes = [_c_int64, _c_int64]
    library.sl_quant_scratch_bytes.restype = _c_int64
    library.sl_quant_matmul.argtypes = [
        _c_int,  # isa
        _c_int,  # n_segments
        _c_void_p,  # qtypes
        _c_void_p,  # weights
        _c_void_p,  # seg_rows
        _c_int64,  # k
        _c_void_p,  # x
        _c_int,  # x_bf16
        _c_int64,  # m
        _c_int64,  # ldx
        _c_void_p,  # bias
        _c_void_p,  # residual
        _c_int64,  # ldr
        _c_void_p,  # y
        _c_int,  # y_bf16
        _c_int64,  # ldy
        _c_void_p,  # scratch
        _c_int,  # threads
    ]
    library.sl_quant_matmul.restype = _c_int
    library.sl_quant_dequantize_rows.argtypes = [
        _c_int,
        _c_void_p,
        _c_int64,
        _c_void_p,
        _c_int64,
        _c_void_p,
        _c_int,  # bfloat16 out
        _c_int,  # threads
    ]
    library.sl_quant_dequantize_rows.restype = _c_int


def best_isa(library: ctypes.CDLL) -> tuple[Isa, str]:
    """The instruction set the kernels use here, and why: ``SLOTSERVE_GGML_ISA`` when set (and
    the CPU has it), else the best one cpuid reports."""
    forced = os.environ.get("SLOTSERVE_GGML_ISA", "").strip().lower()
    if forced:
        try:
            isa = Isa[forced.upper()]
        except KeyError:
            raise KernelBuildError(
                f"SLOTSERVE_GGML_ISA={forced!r}: expected scalar, avx2 or avx512"
            ) from None
        if not library.sl_quant_isa_supported(int(isa)):
            raise KernelBuildError(f"SLOTSERVE_GGML_ISA={forced}: this CPU does not have it")
        return isa, f"{isa.describe} (SLOTSERVE_GGML_ISA)"
    for isa in reversed(Isa):
        if library.sl_quant_isa_supported(int(isa)):
            return isa, f"{isa.describe} (cpuid)"
    return Isa.SCALAR, "scalar C"


def prefetch_level(library: ctypes.CDLL) -> str:
    """Sets where the tile kernels prefetch the rows they read next (L2 on Intel CPUs, L1
    elsewhere; ``SLOTSERVE_GGML_PREFETCH=l1|l2`` chooses) and says which, for the log. On the
    2-core AMX Xeon (family 6 model 167, a 480 MiB L3) L1 stalled the one-row gemv on the
    prefetches (perf: a third of its samples after one, the fill buffers full); L2 took a SmolLM2
    one-row step from 6.9 to 6.2 ms, Gemma 3's Q8_0 head at one row from 8.9-9.5 to 7.0-7.3 ms.
    Zen 4 fills L2 on PREFETCHT1 but is reported to drop such prefetches at times (Wang et al.
    2024, arXiv:2411.02814), and L1 is what was measured on the EPYC: off Intel it stays.

    Raises:
        KernelBuildError: ``SLOTSERVE_GGML_PREFETCH`` is set to something else.
    """
    forced = os.environ.get("SLOTSERVE_GGML_PREFETCH", "").strip().lower()
    if forced not in ("", "l1", "l2"):
        raise KernelBuildError(f"SLOTSERVE_GGML_PREFETCH={forced!r}: expected l1 or l2")
    intel = bool(library.sl_quant_cpu_is_intel())
    to_l2 = forced == "l2" or (not forced and intel)
    library.sl_quant_set_prefetch_l2(int(to_l2))
    why = "SLOTSERVE_GGML_PREFETCH" if forced else ("an Intel CPU" if intel else "not Intel")
    return f"prefetch into {'L2' if to_l2 else 'L1'} ({why})"


@functools.cache
def load_ggml_quant() -> tuple[GGMLKernels | None, str]:
    """Build (once per machine, cached on disk) and load the kernels.

    Returns ``(kernels, how)``: the kernels, or None and the reason they are not available
    (no C compiler, a build error, a forced instruction set the CPU lacks); ``how`` goes into
    the start-up log and ``/info``. Never raises.
    """
    try:
        library, target, threaded = build_library("ggml_quant", SOURCE_DIR, SOURCES, CFLAGS)
        _declare(library)
        isa, why = best_isa(library)
        why += f", {prefetch_level(library)}"
    except KernelBuildError as error:
        return None, str(error)
    except AttributeError as error:  # a library without the functions declared
        return None, f"build or load failed: {error}"
    threads = f"torch's OpenMP threads ({torch_libgomp()})" if threaded else "one thread"
    # asked once here, before any thread computes: the kernel grants the tile state then
    if isa == Isa.AVX512 and library.sl_quant_amx_ready():
        why += f", AMX-INT8 tiles from {AMX_MIN_ROWS} rows (32-weight formats)"
    return GGMLKernels(library, target, isa, threaded), f"GGUF-block kernels: {why}; {threads}"
