"""Waiting for a condition instead of for a time: the one polling loop of scripts and tests.

A condition is a function returning a truth value (or an awaitable of one, for ``wait_for``):
a metric reaching a value, a process answering its health check. It is checked at once, then
every ``poll_s`` seconds until it holds or ``timeout`` seconds pass (then ``ConditionTimeout``,
an AssertionError: in a test, a failure that names what was awaited).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.02


class ConditionTimeout(AssertionError):
    """The condition did not hold within the timeout."""


class _Deadline:
    def __init__(self, timeout: float, what: str, clock: Callable[[], float]) -> None:
        self._timeout, self._what, self._clock = timeout, what, clock
        self._at = clock() + timeout

    def check(self) -> None:
        if self._clock() >= self._at:
            raise ConditionTimeout(f"{self._what} not reached in {self._timeout:g} s")


async def wait_for(
    condition: Callable[[], object | Awaitable[object]],
    timeout: float = 5.0,
    *,
    poll_s: float = POLL_S,
    what: str = "condition",
) -> None:
    """Returns once ``condition()`` is true (awaited when it returns an awaitable)."""
    deadline = _Deadline(timeout, what, asyncio.get_running_loop().time)
    while not await _holds(condition):
        deadline.check()
        await asyncio.sleep(poll_s)


def wait_until(
    condition: Callable[[], object],
    timeout: float = 5.0,
    *,
    poll_s: float = POLL_S,
    what: str = "condition",
) -> None:
    """``wait_for`` for code without an event loop (a server thread starting, a process)."""
    deadline = _Deadline(timeout, what, time.monotonic)
    while not condition():
        deadline.check()
        time.sleep(poll_s)


async def _holds(condition: Callable[[], object | Awaitable[object]]) -> bool:
    result = condition()
    if inspect.isawaitable(result):
        result = await result
    return bool(result)
