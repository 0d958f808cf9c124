"""Server-Sent Events as the clients of scripts and tests read them: one parser, httpx-sse's.

- ``EventStream``: a streamed ``httpx`` response read event by event (``next_event``,
  ``final_event``, or ``async for``), for a client that acts between events (cancels after k
  tokens, times each event);
- ``parse_events``: a whole body at once (a response already read, or the raw chunks a lean
  client kept), for a client that only needs the events at the end.

Comments (the ``: ping`` keep-alive) are not events. An event without an ``event:`` field is a
``message`` (OpenAI's ``data:`` chunks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent

__all__ = ["EventStream", "ServerSentEvent", "json_events", "parse_events"]

_SSE_HEADERS = {"content-type": "text/event-stream"}


def parse_events(body: str | bytes) -> list[ServerSentEvent]:
    """Every event of a complete SSE body, in order."""
    content = body.encode() if isinstance(body, str) else body
    return list(EventSource(httpx.Response(200, headers=_SSE_HEADERS, content=content)).iter_sse())


def json_events(body: str | bytes) -> list[tuple[str, Any]]:
    """(event name, JSON data) of every event that carries data."""
    return [(event.event, event.json()) for event in parse_events(body) if event.data]


class EventStream:
    """One streamed SSE response (status already checked by the caller), read event by event.

    Args:
        response: an ``httpx`` response opened with ``stream=True`` (``client.stream(...)``).
    """

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._events = EventSource(response).aiter_sse()

    @property
    def id(self) -> str:
        """The request id the server answered with (``X-Request-Id``)."""
        return self.response.headers["x-request-id"]

    def __aiter__(self) -> AsyncIterator[ServerSentEvent]:
        return self._events

    async def next_event(self) -> ServerSentEvent:
        """The next event. Raises AssertionError when the stream ends first."""
        async for event in self._events:
            return event
        raise AssertionError(f"stream {self.id} ended without a final event")

    async def final_event(self) -> ServerSentEvent:
        """The first event that is not a ``token`` event (native API: ``done`` or ``error``)."""
        while True:
            event = await self.next_event()
            if event.event != "token":
                return event

    async def aclose(self) -> None:
        await self._events.aclose()
        await self.response.aclose()
