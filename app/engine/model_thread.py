"""The one OS thread that runs every call into the model: loading it and every step.

Why one thread, and the same one for loading: torch's CPU build uses GNU OpenMP, which gives
each OS thread that starts a parallel region its own team of worker threads, and those teams
live as long as their thread. libgomp counts every worker of every team; once there are more
than the machine has CPUs, it switches all of them from spinning between parallel regions to
sleeping after ~100 spins ("throttled", see libgomp's ``GOMP_SPINCOUNT`` documentation), and
``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT`` no longer change that. A decode step is ~1,000 short
parallel regions, so each worker then pays a futex wake-up per region.

Measured on the 2-core CPU (bfloat16, 64 rows, 128-token waves): with the model loaded on
asyncio's default executor thread and stepped on another, the step thread's OpenMP worker was
busy ~55% of the wall time and a 64-stream HTTP wave ran at ~445 tok/s; loaded and stepped on
this one thread, see ``docs/MODEL_PERF.md`` ("One model thread").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

logger = logging.getLogger(__name__)


class ModelThread:
    """A single worker thread; ``run`` awaits ``fn(*args)`` executed on it.

    Calls run one at a time, in the order they were made.
    """

    def __init__(self, name: str = "model-step") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closed = False

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Awaits ``fn(*args, **kwargs)`` on the model thread; its exception is raised here."""
        loop = asyncio.get_running_loop()
        if kwargs:
            return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
        return await loop.run_in_executor(self._executor, fn, *args)

    def start(self, fn: Callable[P, T], *args: P.args) -> asyncio.Future[T]:
        """Queues ``fn(*args)`` on the model thread and returns at once: the future the
        loop awaits after doing its own work meanwhile (the engine's overlap); its exception
        is raised where it is awaited. Must be called from the event loop's thread."""
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def queue(self, fn: Callable[P, T], *args: P.args) -> Future[T]:
        """Queues ``fn(*args)`` after every call already queued, without waiting for it (the
        engine releases a slot this way while a step that uses it is in flight); an exception
        it raises is logged."""
        call = self._executor.submit(fn, *args)
        call.add_done_callback(_log_failure)
        return call

    async def drain(self) -> None:
        """Returns once every call queued so far has run (at once after ``shutdown``)."""
        if not self._closed:
            await self.run(int)  # a no-op call, behind every one queued before it

    def shutdown(self) -> None:
        """No new calls; a call in progress finishes on its own, queued ones are dropped."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)


def _log_failure(call: Future) -> None:
    if not call.cancelled() and (error := call.exception()) is not None:
        logger.error("a call queued on the model thread failed", exc_info=error)
