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
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from app.models.checkpoints.gguf_file import release_view_pages
from app.models.weights.block_arena_prefault import (
    HUGE_PAGE,
    arena_bytes,
    claim,
    huge_pages_mode,
    new_arena_mapping,
    release_unclaimed,
)

__all__ = ["BlockArena", "release_unclaimed"]

ALIGN = 64  # each matrix starts on a cache line
COPY_BYTES = 4 << 20  # copied (and released) this much of a matrix at a time
# Copied by this many threads (np.copyto and madvise release the GIL). The first write to each
# huge page faults it in, and on the VMs measured a lone thread's faults stall unevenly: the
# 1B file's 603 MiB took 0.22-2.1 s on one thread and 0.12-0.16 s on two (2-core AMX Xeon).
COPY_THREADS = max(
    1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
)


class BlockArena:
    """One anonymous mapping that matrices of blocks are copied into, one after another.

    Only the bytes written become resident (the rest of the mapping is address space), plus
    at most one partly used 2 MiB page at the end.
    """

    def __init__(self, capacity: int, mapping: mmap.mmap | None = None) -> None:
        """``capacity``: bytes of address space (rounded up to whole huge pages); ``mapping``:
        memory mapped for it already (:func:`app.models.weights.block_arena_prefault.claim`),
        None: a new one.

        Raises:
            OSError: the mapping could not be made.
        """
        self.faulted_ahead = mapping is not None
        if mapping is None:
            mapping = new_arena_mapping(arena_bytes(capacity - HUGE_PAGE))
        self._raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
        self._used = 0
        self._copiers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="block-arena")

    @classmethod
    def for_file(cls, path: Path) -> BlockArena | None:
        """An arena for the blocks of the file at ``path`` (they are fewer bytes than the
        file), or None where the kernel has no transparent huge pages."""
        if huge_pages_mode() is None:
            return None
        try:
            size = arena_bytes(path.stat().st_size)
            # faulted in while the server imported (block_arena_prefault), else a new mapping
            return cls(size, claim(path, size))
        except OSError:  # no address space for it (strict overcommit, a ulimit): stay mapped
            return None

    def describe(self) -> str:
        """What the arena holds, for the start-up log."""
        mode = huge_pages_mode() or "none"
        ahead = ", faulted in while the server imported" if self.faulted_ahead else ""
        return (
            f"{self._used / 2**20:.1f} MiB copied into 2 MiB pages "
            f"(transparent huge pages: {mode}{ahead})"
        )

    @property
    def used(self) -> int:
        """Bytes handed out so far, alignment included."""
        return self._used

    def take(
        self,
        blocks: np.ndarray,
        repack: Callable[[np.ndarray, np.ndarray], None] | None = None,
    ) -> torch.Tensor:
        """``blocks`` (uint8 ``[rows, bytes per row]``, C-contiguous) copied into the arena:
        a tensor of the same shape over the arena's memory. A view of a file's mapping has
        its pages released once copied (``MADV_DONTNEED``: a private read-only mapping loses
        nothing, a later read faults them in again from the page cache). ``repack``: writes
        a part of whole groups of eight rows (and the last part) into the arena in place of
        the copy (:meth:`app.models.kernels.ggml_quant.GGMLKernels.repack8`).

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
        step = -(-step // 8) * 8  # whole groups of eight rows, for a repack

        def copy(first: int) -> None:
            part = blocks[first : first + step]
            if repack is not None:
                repack(part, target[first : first + step])
            else:
                np.copyto(target[first : first + step], part, casting="no")
            if mapped:
                release_view_pages(part)

        for done in self._copiers.map(copy, range(0, blocks.shape[0], step)):
            del done
        self._used = stop
        return out

    def close(self) -> None:
        """Stops the copying threads and gives back the whole pages past the last matrix (the
        arena is sized by the file, and faulted in whole when it was reserved ahead); the
        matrices' memory stays, held by their tensors."""
        self._copiers.shutdown(wait=True)
        tail = self._raw[self._used :]
        if tail.numel():
            release_view_pages(tail.numpy())  # whole pages only: the last matrix's stays
