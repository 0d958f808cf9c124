"""A greedy step's LM head on a sketch of its Q8_0 blocks (``ggml_quant_sketch.c``).

One decode stream reads every weight once a token, so its speed is bytes over memory
bandwidth; in a small model with a large vocabulary the head is most of those bytes (Gemma 3
270M: 178 of 246 MB a token, its 262,144 x 640 Q8_0 head). Where every logit row of a step is
greedy, nothing but the argmax is wanted (``GGMLLinear.argmax``). :class:`HeadSketch` finds it
for one row from a six-bit copy of the codes (each code without its two low bits: 26 bytes a
block of 32 weights against Q8_0's 34) and bounds that hold every row's exact output, then
computes exactly only the rows whose bound reaches the best row's (2-52 of Gemma 3's
262,144 rows on its own hidden states): the same index as the whole head's call, bit for bit,
for 24% fewer bytes read. The price is the copy's memory, 0.76x the head's (Gemma 3: 136 MB).

``SLOTSERVE_GGML_HEAD_SKETCH=0`` keeps the whole head's call (and no copy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from app.models.kernels.ggml_quant import GGMLKernels, Isa, QuantSegment
from app.models.weights.block_arena_prefault import HUGE_PAGE, huge_pages_mode, new_arena_mapping

# Heads with fewer rows keep the whole call: the second pass's exact groups and the call's
# fixed cost weigh more against a small head, and its copy is memory for little time.
SKETCH_MIN_ROWS = 16384


def huge_page_buffer(size: int) -> torch.Tensor:
    """uint8 ``[size]`` in memory advised into 2 MiB pages, aligned to one, as the block arena's
    (:mod:`app.models.weights.block_arena`: fewer TLB misses on a stream that reads each byte
    once; a 262,144-row sketch read at 28.7-30.3 GB/s against 26.3 on 4 KiB pages, one row,
    AVX-512, a noisy host); ordinary memory where the kernel has no transparent huge pages or
    no address space for the mapping."""
    if huge_pages_mode() is None:
        return torch.empty(size, dtype=torch.uint8)
    try:
        mapping = new_arena_mapping(size + HUGE_PAGE)
    except OSError:
        return torch.empty(size, dtype=torch.uint8)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # (keeps the mapping alive)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + size]


def sketch_enabled() -> bool:
    """``SLOTSERVE_GGML_HEAD_SKETCH`` is not ``0``."""
    return os.environ.get("SLOTSERVE_GGML_HEAD_SKETCH", "1").strip() != "0"


def sketch_bytes(tensor_type: str, rows: int, columns: int) -> int:
    """Bytes of the sketch a head of ``rows`` x ``columns`` in ``tensor_type`` gets (the load's
    memory estimate, and :meth:`HeadSketch.build`'s choice): 208 bytes a block of 32 weights of
    every full group of eight rows (``sl_sketch_q8_0_bytes``), or 0 where it gets none (turned
    off, not Q8_0, under :data:`SKETCH_MIN_ROWS` rows, columns not whole blocks)."""
    if not sketch_enabled() or tensor_type != "Q8_0" or rows < SKETCH_MIN_ROWS:
        return 0
    return rows // 8 * (columns // 32) * 208 if columns > 0 and columns % 32 == 0 else 0


@dataclass(frozen=True, slots=True)
class HeadSketch:
    """The sketch of one Q8_0 matrix (``segment``, the head's only segment).

    Attributes:
        kernels: the loaded library (AVX2 or better).
        segment: the head's blocks (file layout or interleaved).
        columns: ``K``, the head's input width.
        blocks: uint8 ``[sl_sketch_q8_0_bytes]``, the six-bit codes and scales of every full
            group of eight rows (the rows after the last full group are computed exactly).
    """

    kernels: GGMLKernels
    segment: QuantSegment
    columns: int
    blocks: torch.Tensor

    @classmethod
    def build(cls, kernels: GGMLKernels, segment: QuantSegment, columns: int) -> HeadSketch | None:
        """The sketch of ``segment``, or None where it does not apply: turned off, not Q8_0,
        under :data:`SKETCH_MIN_ROWS` rows, no AVX2, or a scale that is not finite (no bound
        holds such a row's output)."""
        size = sketch_bytes(segment.tensor_type, segment.rows, columns)
        if size == 0 or kernels.isa < Isa.AVX2:
            return None
        library = kernels.library
        assert size == library.sl_sketch_q8_0_bytes(segment.rows, columns)
        blocks = huge_page_buffer(size)
        status = library.sl_sketch_q8_0(
            segment.blocks.data_ptr(),
            int(segment.interleaved),
            segment.rows,
            columns,
            blocks.data_ptr(),
        )
        return cls(kernels, segment, columns, blocks) if status == 0 else None

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def argmax(self, x: torch.Tensor, *, isa: Isa | None = None) -> tuple[torch.Tensor, int] | None:
        """The head's argmax for one row ``x [1, columns]`` (float32 or bfloat16, contiguous):
        int64 ``[1]``, torch's index (the first of equal values) of the whole head's float32
        outputs (those of ``isa``'s kernels, default the loaded set), and how many rows were
        computed exactly; or None where the bounds cannot
        decide (an activation or an output not finite: a NaN is torch's largest), and the
        whole head's call must answer.

        Raises:
            ValueError: ``x`` is not one contiguous row of ``columns`` float32 / bfloat16.
            MemoryError: no memory for the call's buffers.
        """
        if x.shape != (1, self.columns) or x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"x must be one row of {self.columns} values, got {tuple(x.shape)}")
        if not x.is_contiguous():
            raise ValueError("x must be contiguous")
        index = torch.zeros(1, dtype=torch.int64)
        exact = torch.zeros(1, dtype=torch.int64)
        status = self.kernels.library.sl_argmax_q8_0_sketched(
            int(self.kernels.isa if isa is None else isa),
            self.segment.blocks.data_ptr(),
            int(self.segment.interleaved),
            self.blocks.data_ptr(),
            self.segment.rows,
            self.columns,
            x.data_ptr(),
            int(x.dtype == torch.bfloat16),
            index.data_ptr(),
            exact.data_ptr(),
            torch.get_num_threads(),
        )
        if status == 1:
            return None
        if status == -2:
            raise MemoryError("no memory for the sketched head's buffers")
        if status != 0:
            raise ValueError(f"the sketched head's call failed ({status})")
        return index, int(exact[0])
