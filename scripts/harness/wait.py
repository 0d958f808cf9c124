"""Waiting for a condition instead of for a time: the one polling loop of scripts and tests.

A condition is a function returning a truth value (or an awaitable of one, for ``wait_for``):
a metric reaching a value, a process answering its health check. It is checked at once, then
every ``poll_s`` seconds until it holds or ``timeout_s`` passes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.02


class ConditionTimeout(AssertionError):
    """The condition did not hold within the timeout (an AssertionError: in a test, a failure)."""


async def wait_for(
    condition: Callable[[], object | Awaitable[object]],
    timeout: float = 5.0,
    *,
    poll_s: float = POLL_S,
    what: str = "condition",
) -> None:
    """Returns once ``condition()`` is true.

    Raises:
        ConditionTimeout: not true within ``timeout`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() >= deadline:
            raise ConditionTimeout(f"{what} not reached in {timeout:g} s")
        await asyncio.sleep(poll_s)


def wait_until(
    condition: Callable[[], object],
    timeout: float = 5.0,
    *,
    poll_s: float = POLL_S,
    what: str = "condition",
) -> None:
    """``wait_for`` for code without an event loop (a server thread starting, a process).

    Raises:
        ConditionTimeout: not true within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise ConditionTimeout(f"{what} not reached in {timeout:g} s")
        time.sleep(poll_s)
