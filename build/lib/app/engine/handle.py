"""The HTTP side's end of one request: a stream of events the scheduler never waits on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from app.engine.request import FinalEvent, GenerationRequest, StreamEvent


class RequestHandle:
    """Collects one request's events; the scheduler pushes, one consumer awaits.

    ``push`` is synchronous and never blocks (an unbounded ``asyncio.Queue``: a slow client can
    never slow the batch; at most ``max_tokens`` events can pile up). It must be called from the
    event loop's thread.

    Args:
        request: the request this handle belongs to.
        on_final: called once with this handle after the final event is pushed.
    """

    def __init__(
        self, request: GenerationRequest, on_final: Callable[[RequestHandle], None]
    ) -> None:
        self.request = request
        self._events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._on_final = on_final
        self.final: FinalEvent | None = None
        self.cancel_requested_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_finished(self) -> bool:
        return self.final is not None

    def push(self, event: StreamEvent) -> None:
        if self.final is not None:
            return  # nothing may follow the final event
        self._events.put_nowait(event)
        if isinstance(event, FinalEvent):
            self.final = event
            self._on_final(self)

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Yields events in order; the last one is the ``FinalEvent``."""
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, FinalEvent):
                return

    async def result(self) -> FinalEvent:
        """Waits for the final event (token events are skipped: the final one has the text)."""
        async for event in self.events():
            if isinstance(event, FinalEvent):
                return event
        raise RuntimeError("event stream ended without a final event")
