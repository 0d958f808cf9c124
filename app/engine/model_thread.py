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

The hand-over is a ``queue.SimpleQueue`` of calls and, for the loop's calls, an asyncio
future settled through ``call_soon_threadsafe``: the same order and the same wake-ups as
``run_in_executor`` on a one-worker ``ThreadPoolExecutor``, without its
``concurrent.futures.Future``, work item, worker semaphore and the callbacks that chain it
to an asyncio future. A step's round trip cost the two threads ~55-73 us of CPU that way and
~39-43 us this way (a no-op call, uvloop, the 2-core AMD EPYC): with a 0 ms mock step of one
row that hand-over was most of a step's cost (``docs/ENGINE_LOOP.md``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

logger = logging.getLogger(__name__)

_IDLE_CHECK_S = 0.5  # how often an idle thread looks whether the interpreter is exiting

# One queued call: (fn, args, the loop to settle ``future`` on, or None for a
# ``concurrent.futures.Future`` settled on the thread itself, future).
_Call = tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop | None, Any]


class ModelThread:
    """A single worker thread; ``run`` awaits ``fn(*args)`` executed on it.

    Calls run one at a time, in the order they were made. A loop's call cancelled before it
    started is skipped (as ``run_in_executor``'s is); one that started runs to its end.

    Raises:
        RuntimeError: from ``run``, ``start`` and ``queue`` after ``shutdown``.
    """

    def __init__(self, name: str = "model-step") -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._closed = False
        # Not a daemon: an interpreter that exits waits for the call in progress (a model
        # still loading after a Ctrl-C), as it did for the executor's worker; an idle thread
        # ends once the main thread has (``_serve``), or once this object is collected
        # without ``shutdown`` (the thread holds the queue only, never ``self``).
        self._thread = threading.Thread(target=_serve, args=(self._calls,), name=name)
        self._thread.start()
        weakref.finalize(self, self._calls.put, None)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Awaits ``fn(*args, **kwargs)`` on the model thread; its exception is raised here."""
        if kwargs:
            return await self.start(lambda: fn(*args, **kwargs))
        return await self.start(fn, *args)

    def start(self, fn: Callable[P, T], *args: P.args) -> asyncio.Future[T]:
        """Queues ``fn(*args)`` on the model thread and returns at once: the future the
        loop awaits after doing its own work meanwhile (the engine's overlap); its exception
        is raised where it is awaited. Must be called from the event loop's thread."""
        self._check_open()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((fn, args, loop, future))
        return future

    def queue(self, fn: Callable[P, T], *args: P.args) -> Future[T]:
        """Queues ``fn(*args)`` after every call already queued, without waiting for it (the
        engine releases a slot this way while a step that uses it is in flight); an exception
        it raises is logged."""
        self._check_open()
        call: Future[T] = Future()
        call.add_done_callback(_log_failure)
        self._calls.put((fn, args, None, call))
        return call

    async def drain(self) -> None:
        """Returns once every call queued so far has run (at once after ``shutdown``)."""
        if not self._closed:
            await self.run(int)  # a no-op call, behind every one queued before it

    def shutdown(self) -> None:
        """No new calls; a call in progress finishes on its own, queued ones are dropped
        (their futures cancelled)."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                _cancel(call)
        self._calls.put(None)  # the thread ends after the call in progress

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the model thread is shut down")


def _serve(calls: queue.SimpleQueue[_Call | None]) -> None:
    """The model thread: runs the calls in order until ``None`` (``shutdown``, or its
    ``ModelThread`` collected) or, while idle, until the main thread has ended."""
    main = threading.main_thread()
    while True:
        try:
            call = calls.get(timeout=_IDLE_CHECK_S)
        except queue.Empty:
            if not main.is_alive():  # the interpreter is exiting
                return
            continue
        if call is None:
            return
        fn, args, loop, future = call
        if loop is None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as error:  # noqa: BLE001 (the caller's to see)
                    future.set_exception(error)
            continue
        if future.cancelled():  # its caller gave up before it started
            continue
        try:
            result = fn(*args)
        except BaseException as error:  # noqa: BLE001 (raised where it is awaited)
            _settle_soon(loop, future, None, error)
        else:
            _settle_soon(loop, future, result, None)


def _settle_soon(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
) -> None:
    """Settles ``future`` on its loop's thread (nobody is left to tell if the loop closed)."""
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:  # the loop is closed
        pass


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled while the call ran
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, StopIteration):  # a future cannot hold one: it would never settle
        failure = RuntimeError(f"a call on the model thread raised {error!r}")
        failure.__cause__ = error
        future.set_exception(failure)
    else:
        future.set_exception(error)


def _cancel(call: _Call) -> None:
    _, _, loop, future = call
    if loop is None:
        future.cancel()
        return
    try:
        loop.call_soon_threadsafe(future.cancel)
    except RuntimeError:  # the loop is closed: nobody awaits it
        pass


def _log_failure(call: Future) -> None:
    if not call.cancelled() and (error := call.exception()) is not None:
        logger.error("a call queued on the model thread failed", exc_info=error)
