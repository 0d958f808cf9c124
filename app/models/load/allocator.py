"""glibc allocator settings for the model process: memory freed at load goes back to the OS,
and a step's activation buffers stay in the heap. Both are no-ops without glibc.
"""

from __future__ import annotations

import ctypes
import gc


def return_freed_memory_to_the_os() -> None:
    """Loading dequantises every tensor to float32 before casting it; glibc keeps part of that
    freed heap (~30 MiB for SmolLM2) unless asked to hand it back. A no-op without glibc."""
    gc.collect()
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    malloc_trim(0)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Activations of a 64-row step are 0.1-6 MiB each; below this size they come from the heap.
STEP_BUFFER_HEAP_LIMIT = 64 * 2**20


def keep_step_buffers_in_the_heap() -> None:
    """Serve a step's activation buffers from the heap instead of fresh mappings.

    glibc hands out blocks above its mmap threshold (128 KiB, raised dynamically only as such
    blocks are freed) as new ``mmap`` pages, which the kernel zero-fills on first touch and
    ``munmap`` returns at every free: a 64-row step allocates hundreds of such buffers. In the
    server the step runs on a worker thread, whose malloc arena also starts from the low
    threshold. Measured (bfloat16, 64 decode rows, 2-core CPU): 82-90 ms a step on the worker
    thread against 66-74 ms on the main thread; with a fixed 64 MiB threshold both ~55-63 ms.
    The trim threshold is raised with it so freed heap is kept for the next step (RSS then
    holds the largest step's buffers, tens of MiB). A no-op without glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, STEP_BUFFER_HEAP_LIMIT)
    mallopt(_M_TRIM_THRESHOLD, 4 * STEP_BUFFER_HEAP_LIMIT)
