"""Where a GGUF load keeps its blocks: anonymous memory advised into 2 MiB pages.

A decode step streams every block once, so at one row it is bound by memory reads, and the
file's own mapping is 4 KiB pages of the page cache: the 1B Q4_K file's 603 MiB are ~154k
pages, and the TLB misses of walking them cost a share of each step. Copied into memory
advised with ``MADV_HUGEPAGE`` (the kernel's transparent huge pages, in ``madvise`` mode on
the machines measured) the same bytes are ~300 pages. Measured on the 2-core AMX Xeon, the
1B file's decode step (``scenarios/speculation.step_cost``, context 256, medians of 15):
70-72 against 62-65 ms at one row (1.10-1.13x), 123-126 against 106 ms at 8 rows (1.16x);
SmolLM2's 100 MiB file moved within noise. The copy replaces the file's bytes (each copied
range of the mapping is released at once, so the load's resident memory never holds both) and
costs a memory copy at load instead of the page faults of the first step.

Where the kernel has no transparent huge pages (``never``, or not Linux), nothing would be
gained and the blocks stay the file's mapped bytes: :meth:`BlockArena.for_file` returns None.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch

from app.models.checkpoints.gguf_file import release_view_pages

HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page
ALIGN = 64  # each matrix starts on a cache line
COPY_BYTES = 4 << 20  # copied (and released) this much of a matrix at a time
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``), or None when it has
    none (``never``, no such file: not Linux)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    mode = text[start + 1 : end] if 0 <= start < end else ""
    return mode if mode in ("always", "madvise") else None


class BlockArena:
    """One anonymous mapping that matrices of blocks are copied into, one after another.

    Only the bytes written become resident (the rest of the mapping is address space), plus
    at most one partly used 2 MiB page at the end.
    """

    def __init__(self, capacity: int) -> None:
        """``capacity``: bytes of address space (rounded up to whole huge pages).

        Raises:
            OSError: the mapping could not be made.
        """
        size = max(HUGE_PAGE, -(-capacity // HUGE_PAGE) * HUGE_PAGE)
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mapping.madvise(mmap.MADV_HUGEPAGE)
        self._raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
        self._used = 0

    @classmethod
    def for_file(cls, path: Path) -> BlockArena | None:
        """An arena for the blocks of the file at ``path`` (they are fewer bytes than the
        file), or None where the kernel has no transparent huge pages."""
        if huge_pages_mode() is None:
            return None
        try:
            return cls(path.stat().st_size + HUGE_PAGE)
        except OSError:  # no address space for it (strict overcommit, a ulimit): stay mapped
            return None

    def describe(self) -> str:
        """What the arena holds, for the start-up log."""
        mode = huge_pages_mode() or "none"
        return (
            f"{self._used / 2**20:.1f} MiB copied into 2 MiB pages (transparent huge pages: {mode})"
        )

    @property
    def used(self) -> int:
        """Bytes handed out so far, alignment included."""
        return self._used

    def take(self, blocks: np.ndarray) -> torch.Tensor:
        """``blocks`` (uint8 ``[rows, bytes per row]``, C-contiguous) copied into the arena:
        a tensor of the same shape over the arena's memory. A view of a file's mapping has
        its pages released once copied (``MADV_DONTNEED``: a private read-only mapping loses
        nothing, a later read faults them in again from the page cache).

        Raises:
            MemoryError: the arena is full (more bytes than the file holds).
        """
        start = -(-self._used // ALIGN) * ALIGN
        stop = start + blocks.nbytes
        if stop > self._raw.numel():
            raise MemoryError(f"block arena full: {stop} of {self._raw.numel()} bytes")
        out = self._raw[start:stop].view(blocks.shape)
        target = out.numpy()
        mapped = not blocks.flags.writeable
        # a few MiB at a time, each part of a file's view released once copied: the load never
        # holds a whole matrix twice (an LM head is tens of MiB)
        step = max(1, COPY_BYTES // max(1, blocks.nbytes // max(1, len(blocks))))
        for first in range(0, blocks.shape[0], step):
            part = blocks[first : first + step]
            np.copyto(target[first : first + step], part, casting="no")
            if mapped:
                release_view_pages(part)
        self._used = stop
        return out
