"""The GGUF-block library's C side as Python sees it (:mod:`app.models.kernels.ggml_quant`):
the functions' ctypes signatures and a product's call arguments, and what the library runs on
this CPU, chosen at run time: the instruction set (cpuid, or ``SLOTSERVE_GGML_ISA``) and where
its kernels prefetch."""

from __future__ import annotations

import ctypes
import os
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

from app.models.kernels.build import KernelBuildError

if TYPE_CHECKING:
    from app.models.kernels.ggml_quant import PreparedSegments

__all__ = ["Isa", "best_isa", "call_arguments", "check_status", "declare", "prefetch_level"]


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


def declare(library: ctypes.CDLL) -> None:
    library.sl_quant_isa_supported.argtypes = [_c_int]
    library.sl_quant_isa_supported.restype = _c_int
    library.sl_quant_amx_ready.argtypes = []
    library.sl_quant_amx_ready.restype = _c_int
    library.sl_quant_set_prefetch_l2_rows.argtypes = [_c_int64]
    library.sl_quant_set_prefetch_l2_rows.restype = None
    library.sl_quant_tiles_taken_over.argtypes = []
    library.sl_quant_tiles_taken_over.restype = _c_int64
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
    library.sl_quant_argmax.argtypes = [
        *library.sl_quant_matmul.argtypes[:11],  # isa .. bias, as sl_quant_matmul's
        _c_void_p,  # index (int64 [m])
        _c_int,  # threads
    ]
    library.sl_quant_argmax.restype = _c_int
    library.sl_sketch_q8_0_bytes.argtypes = [_c_int64, _c_int64]
    library.sl_sketch_q8_0_bytes.restype = _c_int64
    library.sl_sketch_q8_0.argtypes = [_c_void_p, _c_int, _c_int64, _c_int64, _c_void_p]
    library.sl_sketch_q8_0.restype = _c_int
    library.sl_argmax_q8_0_sketched.argtypes = [
        _c_int,  # isa
        _c_void_p,  # w
        _c_int,  # x8
        _c_void_p,  # sketch
        _c_int64,  # rows
        _c_int64,  # k
        _c_void_p,  # x (one row)
        _c_int,  # x_bf16
        _c_void_p,  # index (int64 [1])
        _c_void_p,  # exact (int64 [1])
        _c_int,  # threads
    ]
    library.sl_argmax_q8_0_sketched.restype = _c_int
    library.sl_quant_repack8.argtypes = [_c_int, _c_void_p, _c_void_p, _c_int64, _c_int64]
    library.sl_quant_repack8.restype = _c_int
    library.sl_quant_dequantize_rows.argtypes = [
        _c_int,
        _c_void_p,
        _c_int64,  # rows of the matrix
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


# Calls of up to this many activation rows prefetch into L2 (where the CPU's vendor was
# measured), wider ones into L1. AMX Xeon: Gemma 3's 64-row steps 137-145 ms into L1, 144-149
# into L2; 32 rows 56-58 against 53-55. Zen 4 EPYC: Gemma 3's 64-row step 130.0 ms into L1,
# 121.0 into L2, the 1B Q4_K file's 399 and 367; a 512-token prompt 3,227 and 3,246 (even).
PREFETCH_L2_ROWS_INTEL = 32
PREFETCH_L2_ROWS_OTHER = 64


def prefetch_level(library: ctypes.CDLL) -> str:
    """Sets where the tile kernels prefetch the rows they read next (into L2 for calls of up to
    32 activation rows on Intel CPUs and 64 elsewhere, wider ones into L1;
    ``SLOTSERVE_GGML_PREFETCH=l1|l2`` chooses the level of the narrow calls) and says which,
    for the log. On the 2-core AMX Xeon (family 6 model 167, a 480 MiB L3) L1 stalled the
    one-row gemv on the prefetches (perf: a third of its samples after one, the fill buffers
    full); L2 took a SmolLM2 one-row step from 6.9 to 6.2 ms, Gemma 3's Q8_0 head at one row
    from 8.9-9.5 to 7.0-7.3 ms. On the 2-core Zen 4 EPYC (family 25 model 17) the same: perf put
    9% of a 1B Q4_K file's 8-row gemv on the instruction after a PREFETCHT0, and L2 took its
    model step from 25.9 to 21.7 ms at one row and 65.6 to 53.9 at 8 (its AVX2 kernels: 34.4 to
    27.5 at one row), SmolLM2's from 6.14 to 5.32 at one row, Gemma 3's from 41.5 to 36.1 at
    16 rows (10.02 against 10.47 at one: even); one process, the two levels in turns
    (docs/MODEL_PERF.md). The AVX2-only EPYC is the same Zen 4 with AVX-512 hidden.

    Raises:
        KernelBuildError: ``SLOTSERVE_GGML_PREFETCH`` is set to something else.
    """
    forced = os.environ.get("SLOTSERVE_GGML_PREFETCH", "").strip().lower()
    if forced not in ("", "l1", "l2"):
        raise KernelBuildError(f"SLOTSERVE_GGML_PREFETCH={forced!r}: expected l1 or l2")
    intel = bool(library.sl_quant_cpu_is_intel())
    rows = PREFETCH_L2_ROWS_INTEL if intel else PREFETCH_L2_ROWS_OTHER
    if forced == "l1":
        library.sl_quant_set_prefetch_l2_rows(0)
        return "prefetch into L1 (SLOTSERVE_GGML_PREFETCH)"
    library.sl_quant_set_prefetch_l2_rows(rows)
    why = "SLOTSERVE_GGML_PREFETCH" if forced else ("an Intel CPU" if intel else "not Intel")
    return f"prefetch into L2 up to {rows} rows, L1 wider ({why})"


def call_arguments(
    isa: Isa, prepared: PreparedSegments, x: torch.Tensor, bias: torch.Tensor | None
) -> tuple:
    """The first arguments of ``sl_quant_matmul`` and ``sl_quant_argmax`` (isa .. bias).

    Raises:
        ValueError: ``x`` is not float32 or bfloat16 rows.
    """
    if x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1:
        raise ValueError(f"x must be float32 or bfloat16 rows, got {x.dtype} {x.stride()}")
    rows, columns = x.shape
    bf16 = int(x.dtype == torch.bfloat16)
    return (
        int(isa),
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
    )


def check_status(status: int, prepared: PreparedSegments, columns: int) -> None:
    """Raises what a kernel call's ``status`` says (MemoryError for -2, ValueError for -1)."""
    if status == -2:
        raise MemoryError("no memory for the quantised activations")
    if status != 0:
        kinds = [s.tensor_type for s in prepared.segments]
        raise ValueError(f"segments {kinds} of width {columns}")
