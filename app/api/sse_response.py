"""The SSE response of every streamed answer: sse-starlette's ``EventSourceResponse`` with its
send timeout (the stall guard: a client that stopped reading is cut off) kept by one watchdog a
stream instead of a cancel scope and timer a send.

sse-starlette bounds each send with ``anyio.move_on_after(send_timeout)``: a cancel scope and a
loop timer created, entered and cancelled for every chunk written, ~7 us of the event loop's
thread each (uvloop, 2-core AMD EPYC), where the chunk's own write costs less. At 256 streams of
one token a step that was ~15% of the server's CPU a token (docs/ENGINE_LOOP.md). Here a send
records when it started, and a watchdog task in the response's own task group wakes every
quarter of the timeout and raises sse-starlette's ``SendTimeoutError`` when a send has been
pending for the whole timeout: the task group then cancels the stalled send and the body
(whose ``finally`` cancels the requests), as sse-starlette's own timeout does. A stalled client
is cut off after between 1 and 1.25 timeouts instead of exactly 1.

It overrides ``_send_with_timeout``, a private method of sse-starlette, and relies on its
``_stream_response`` closing the body when a send is cancelled (3.6 and later; before, only on
its own timeout: the request would keep its slot). So ``pyproject.toml`` pins sse-starlette to
3.7.1-3.7.x, the versions it was measured and tested on, the import refuses others, and
``tests/http/test_slow_client.py`` checks that a stalled reader is still cut off.
"""

from __future__ import annotations

import logging
import re
import time
from importlib.metadata import version
from typing import Any

import anyio
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The sse-starlette releases this override was checked against: [first, past_last).
SUPPORTED_SSE_STARLETTE = ((3, 7, 1), (3, 8, 0))


def _release(text: str) -> tuple[int, ...]:
    """``"3.7.1"`` -> ``(3, 7, 1)`` (missing parts 0, suffixes ignored)."""
    numbers = [int(part) for part in re.findall(r"\d+", text)[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


_installed = version("sse-starlette")
if not (
    SUPPORTED_SSE_STARLETTE[0] <= _release(_installed) < SUPPORTED_SSE_STARLETTE[1]
    and callable(getattr(EventSourceResponse, "_send_with_timeout", None))
):  # pragma: no cover
    raise ImportError(
        f"sse-starlette {_installed} is not one app/api/sse_response.py supports (3.7.1-3.7.x)"
    )

logger = logging.getLogger(__name__)

# The watchdog wakes this many times a timeout.
WATCH_PERIODS = 4

# The scope key under which StackSend leaves the send its middleware stack was called with.
STACK_SEND_KEY = "slotserve.stack_send"


class StackSend:
    """The outermost layer of the app's middleware stack (``FastAPI.build_middleware_stack``
    wrapped): it leaves the ``send`` the stack was called with (uvicorn's, or the one FastAPI's
    own telemetry wraps when on) in the scope, so that a stream's body chunks can skip the
    stack's send wrappers (Starlette's ServerErrorMiddleware, FastAPI's body limit,
    RequestIdMiddleware, ExceptionMiddleware, the route's handler). Each of them only notes the
    ``http.response.start`` message or adds its headers, which still pass through them all.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[STACK_SEND_KEY] = send
        await self.app(scope, receive, send)


class WatchedEventSourceResponse(EventSourceResponse):
    """``EventSourceResponse`` whose ``send_timeout`` (seconds, or None: no limit) is kept by a
    watchdog task. The other arguments are ``EventSourceResponse``'s; ``data_sender_callable``
    is taken by the watchdog.

    Raises (from the ASGI call): ``SendTimeoutError`` when one send stayed pending for
    ``send_timeout`` seconds, as ``EventSourceResponse`` does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("data_sender_callable") is not None:
            raise ValueError("data_sender_callable is the send watchdog's")
        super().__init__(*args, **kwargs)
        # start time of each pending send (a ping and a chunk may be pending at once)
        self._pending_sends: dict[object, float] = {}
        self._watching = False
        if self.send_timeout is not None:
            self.data_sender_callable = self._watch_sends
        self._stack_send: Send | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The response; a client that stopped reading for ``send_timeout`` seconds is cut off
        with one warning line (the stream's request is cancelled by its body's cleanup), not
        an exception through every middleware to uvicorn: an expected, configured outcome
        that logged ~270 lines of tracebacks for one ``n: 16`` stream (found by a helper).
        uvicorn then closes the connection of the unfinished response (its one line)."""
        self._stack_send = scope.get(STACK_SEND_KEY)
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            request_id = scope.get("state", {}).get("request_id", "-")
            logger.warning(
                "%s %s (request id %s): the client read nothing for %g s: stream cut off",
                scope.get("method"),
                scope.get("path"),
                request_id,
                self.send_timeout,
            )

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if not self._watching:  # (before and after the task group: the timeout per send)
            await super()._send_with_timeout(send, message)
            return
        if self._stack_send is not None and message["type"] == "http.response.body":
            # after the start message (the protocol's order): past the stack's wrappers, which
            # note only that one (StackSend); 4-5 coroutine calls less a chunk
            send = self._stack_send
        key = object()
        self._pending_sends[key] = time.monotonic()
        try:
            await send(message)
        except BaseException:
            self._send_interrupted = True
            raise
        finally:
            del self._pending_sends[key]

    async def _watch_sends(self) -> None:
        """Runs in the response's task group until it is cancelled (the stream ended).

        Raises:
            SendTimeoutError: a send has been pending for ``send_timeout`` seconds.
        """
        timeout = self.send_timeout
        assert timeout is not None
        self._watching = True
        try:
            while True:
                await anyio.sleep(timeout / WATCH_PERIODS)
                pending = self._pending_sends.values()
                if pending and time.monotonic() - min(pending) >= timeout:
                    self._send_interrupted = True
                    raise SendTimeoutError()
        finally:
            self._watching = False
