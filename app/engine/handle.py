"""The HTTP side's end of one request (a stream of events the scheduler never waits on), and the
registry of the requests in flight."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from app.engine.request import FinalEvent, GenerationRequest, StreamEvent


class RequestHandle:
    """Collects one request's events; the scheduler pushes, a consumer awaits.

    ``push`` is synchronous and never blocks (an unbounded queue: a slow client can never slow
    the batch; at most ``max_tokens`` events can pile up). It must be called from the event
    loop's thread. The queue is a deque with the futures of the consumers waiting on it, woken
    by the push that follows: what ``asyncio.Queue`` does, without its task accounting and
    getter bookkeeping (at 256 slots a step pushed 256 events and woke 256 readers, a tenth of
    the loop's time; docs/ENGINE_LOOP.md).

    Args:
        request: the request this handle belongs to.
        on_final: called once with this handle after the final event is pushed.
    """

    def __init__(
        self, request: GenerationRequest, on_final: Callable[[RequestHandle], None]
    ) -> None:
        self.request = request
        self._events: deque[StreamEvent] = deque()
        self._waiters: list[asyncio.Future[None]] = []
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
        self._events.append(event)
        if self._waiters:
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._waiters.clear()
        if isinstance(event, FinalEvent):
            self.final = event
            self._on_final(self)

    async def _queued(self) -> None:
        """Returns once an event is queued (at once when one is)."""
        while not self._events:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Yields events in order; the last one is the ``FinalEvent``."""
        events = self._events
        while True:
            if not events:
                await self._queued()
            event = events.popleft()
            yield event
            if isinstance(event, FinalEvent):
                return

    async def event_batches(self) -> AsyncIterator[list[StreamEvent]]:
        """Yields, each time the consumer wakes, every event queued since it last took some
        (one or more, in order): one step's events for the request together, or more when
        the consumer fell behind, so a writer can send them in one write. The last batch
        ends with the ``FinalEvent``."""
        events = self._events
        while True:
            if not events:
                await self._queued()
            batch = list(events)
            events.clear()
            yield batch
            if isinstance(batch[-1], FinalEvent):
                return

    async def result(self) -> FinalEvent:
        """Waits for the final event (token events are skipped: the final one has the text)."""
        async for event in self.events():
            if isinstance(event, FinalEvent):
                return event
        raise RuntimeError("event stream ended without a final event")


class InFlightRequests:
    """The handles of requests in flight, by request id: the one place that answers "is this id
    taken?" (409) and "which request does DELETE mean?".

    A handle leaves when its final event is pushed or when its cancel is asked for (a second
    cancel is then a miss). ``wait_empty`` lets a drain wait for the last one without polling.
    """

    def __init__(self) -> None:
        self._by_id: dict[str, RequestHandle] = {}
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[RequestHandle]:
        return iter(list(self._by_id.values()))

    def get(self, request_id: str) -> RequestHandle | None:
        return self._by_id.get(request_id)

    def add(self, handle: RequestHandle) -> None:
        """Raises KeyError when a request with that id is already in flight."""
        if handle.request_id in self._by_id:
            raise KeyError(handle.request_id)
        self._by_id[handle.request_id] = handle
        self._empty.clear()

    def discard(self, handle: RequestHandle) -> None:
        """Removes ``handle``; a different request now holding its id stays (rule R17)."""
        if self._by_id.get(handle.request_id) is handle:
            del self._by_id[handle.request_id]
            if not self._by_id:
                self._empty.set()

    async def wait_empty(self) -> None:
        """Returns once no request is in flight."""
        await self._empty.wait()
