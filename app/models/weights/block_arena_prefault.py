"""The block arena's memory, faulted in while the server is still importing.

A GGUF load copies the file's blocks into 2 MiB pages (:mod:`app.models.weights.block_arena`),
and the first write to each page faults it in. On a virtual machine that first touch can cost
far more than the copy: the hypervisor backs the guest's page on its own first touch. Measured
on the 2-core AMX Xeon (KVM), the 1B Q4_K file's 603 MiB copied in 0.12-0.2 s into memory
faulted in beforehand and in 0.6-1.9 s into fresh memory, most of a 2-4 s load.

:func:`reserve`, called by ``python -m app serve`` once its flags are parsed and before it
imports torch and the app (~1.5 s of one core), maps the arena and has a thread fault it in
(``madvise(MADV_POPULATE_WRITE)``, which runs in the kernel with the GIL released, in
``POPULATE_CHUNK`` pieces so that the importing thread's own mappings are not held up) on the
other core; :meth:`app.models.weights.block_arena.BlockArena.for_file` then claims it. This module
imports nothing heavy, so that it can run first.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from pathlib import Path

import psutil

HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (include/uapi/asm-generic/mman-common.h)
GGUF_MAGIC = b"GGUF"
# Bytes faulted in by one madvise call. The kernel holds the process's mmap lock while it
# faults a call's range in, and the importing thread's new mappings (an extension module's
# dlopen, a large malloc) wait for that lock: faulted in as one 600 MiB call, the 1B Q4_K
# file's arena held the import of fastapi for 1.5 s, more than the fault-in saved. Between 8 MiB
# calls the lock is free (the 1B file's start on the AMX Xeon, in an hour when the VM's first
# touch of memory was slow: 4.3-5.0 s -> 3.4-4.0 s; when it is fast, the stall is short).
POPULATE_CHUNK = 4 * HUGE_PAGE
# A file larger than this share of the memory available now is not faulted in ahead: the load's
# memory check (app.models.load.plan) has not run yet, and it must be the one that refuses.
MAX_SHARE_OF_AVAILABLE = 0.5

logger = logging.getLogger(__name__)

_reserved: dict[Path, mmap.mmap] = {}


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


def arena_bytes(file_bytes: int) -> int:
    """Bytes of address space an arena for a file of ``file_bytes`` maps: the file's size plus
    one huge page (alignment), rounded up to whole huge pages."""
    return max(HUGE_PAGE, -(-(file_bytes + HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE)


def new_arena_mapping(size: int) -> mmap.mmap:
    """An anonymous private mapping of ``size`` bytes advised into huge pages.

    Raises:
        OSError: the mapping could not be made (no address space: strict overcommit, a ulimit).
    """
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def reserve(model: str) -> bool:
    """Maps the arena for the GGUF file ``model`` names and starts faulting it in on a
    background thread; True when it did. Nothing happens (False) for a name that is not a
    readable GGUF file, without transparent huge pages, or for a file larger than half the
    memory available now. Never raises: whatever goes wrong here, the load maps its own."""
    path = Path(model)
    if huge_pages_mode() is None:
        return False
    try:
        with path.open("rb") as file:
            if file.read(4) != GGUF_MAGIC:
                return False
            size = arena_bytes(os.fstat(file.fileno()).st_size)
        if size > MAX_SHARE_OF_AVAILABLE * _available_bytes():
            return False
        mapping = new_arena_mapping(size)
    except (OSError, ValueError):
        return False
    _reserved[path.resolve()] = mapping
    threading.Thread(
        target=_populate, args=(mapping,), name="block-arena-prefault", daemon=True
    ).start()
    return True


def claim(path: Path, size: int) -> mmap.mmap | None:
    """The mapping :func:`reserve` made for ``path`` if it is ``size`` bytes (the file was
    not rewritten since), handed over once; None otherwise."""
    mapping = _reserved.pop(path.resolve(), None)
    if mapping is not None and len(mapping) != size:
        _close(mapping)
        return None
    return mapping


def release_unclaimed() -> None:
    """Unmaps what no load claimed (a plan that kept dense weights, a refused model)."""
    while _reserved:
        _close(_reserved.popitem()[1])


def _close(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # the fault-in thread still holds it: unmapped when it ends
        pass


def _populate(mapping: mmap.mmap) -> None:
    view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        base = ctypes.addressof(view)
        for offset in range(0, len(view), POPULATE_CHUNK):
            length = min(POPULATE_CHUNK, len(view) - offset)
            start = ctypes.c_void_p(base + offset)
            if libc.madvise(start, ctypes.c_size_t(length), MADV_POPULATE_WRITE):
                logger.debug("arena fault-in: madvise errno %d", ctypes.get_errno())
                break
    except (OSError, AttributeError):
        pass
    finally:
        del view


def _available_bytes() -> int:
    """Memory available now (bytes), as the load's own check reads it (psutil)."""
    return int(psutil.virtual_memory().available)
