"""The SSE response's send watchdog (app/api/sse_response.py): body chunks are written without
sse-starlette's cancel scope a send, a stalled send is still cut off, and its body's cleanup
runs. Driven as a bare ASGI app: the stalled client is a ``send`` that never returns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError

from app.api.sse_response import WatchedEventSourceResponse


def _scope() -> dict:
    return {"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": b""}


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


async def test_chunks_are_sent_without_a_cancel_scope_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scoped: list[dict] = []
    original = EventSourceResponse._send_with_timeout

    async def counting(self, send, message) -> None:  # sse-starlette's per-send timeout
        scoped.append(message)
        await original(self, send, message)

    monkeypatch.setattr(EventSourceResponse, "_send_with_timeout", counting)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def body() -> AsyncIterator[bytes]:
        for index in range(50):
            await asyncio.sleep(0)  # the watchdog starts while the body waits, as an engine's
            yield b"data: %d\n\n" % index

    response = WatchedEventSourceResponse(body(), send_timeout=5.0, ping=600)
    await response(_scope(), _never_disconnects, send)
    chunks = [m["body"] for m in sent if m["type"] == "http.response.body" and m["body"]]
    assert chunks == [b"data: %d\n\n" % i for i in range(50)]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    scoped_chunks = [m for m in scoped if m["type"] == "http.response.body" and m["body"]]
    assert len(scoped_chunks) <= 1  # (the first may go before the watchdog runs), not 50


async def test_a_stalled_send_is_cut_off_and_the_body_cleaned_up() -> None:
    cleaned = asyncio.Event()
    stalled = asyncio.Event()

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            stalled.set()
            await asyncio.Event().wait()  # the client stopped reading

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                await asyncio.sleep(0)
                yield b"data: x\n\n"
        finally:
            cleaned.set()

    timeout = 0.2
    response = WatchedEventSourceResponse(body(), send_timeout=timeout, ping=600)
    started = time.monotonic()
    with pytest.raises(SendTimeoutError):
        await asyncio.wait_for(response(_scope(), _never_disconnects, send), 10 * timeout)
    waited = time.monotonic() - started
    assert stalled.is_set() and cleaned.is_set()
    assert timeout <= waited < 1.25 * timeout + 0.5  # a quarter timeout's watch, and slack
    assert not response._pending_sends and not response._watching


async def test_without_a_timeout_there_is_no_watchdog() -> None:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    response = WatchedEventSourceResponse(body(), send_timeout=None, ping=600)
    assert response.data_sender_callable is None
    await response(_scope(), _never_disconnects, send)
    assert [m["body"] for m in sent if m["type"] == "http.response.body"] == [b"data: 1\n\n", b""]


def test_the_data_sender_hook_is_the_watchdogs() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b""

    async def sender() -> None:
        return None

    with pytest.raises(ValueError, match="watchdog"):
        WatchedEventSourceResponse(body(), send_timeout=1.0, data_sender_callable=sender)


def test_the_supported_sse_starlette_releases_are_parsed_and_checked() -> None:
    from app.api import sse_response

    assert sse_response._release("3.7.1") == (3, 7, 1)
    assert sse_response._release("3.8") == (3, 8, 0)
    assert sse_response._release("3.7.2rc1") == (3, 7, 2)
    first, past_last = sse_response.SUPPORTED_SSE_STARLETTE
    assert first <= sse_response._release(sse_response._installed) < past_last
    assert not first <= sse_response._release("3.5.0") < past_last  # no cleanup on cancel there
