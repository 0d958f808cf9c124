"""The SSE response's send watchdog (app/api/sse_response.py): body chunks are written without
sse-starlette's cancel scope a send, a stalled send is still cut off, and its body's cleanup
runs. Driven as a bare ASGI app: the stalled client is a ``send`` that never returns. And the
server's streams write their chunks past the middleware stack's send wrappers (StackSend)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from sse_starlette import EventSourceResponse

from app.api.server import create_app
from app.api.sse_response import WatchedEventSourceResponse
from tests.http.conftest import RecordingMock, mock_config, parse_sse


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


async def test_a_stalled_send_is_cut_off_and_the_body_cleaned_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
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
    with caplog.at_level(logging.WARNING, logger="app.api.sse_response"):
        await asyncio.wait_for(response(_scope(), _never_disconnects, send), 10 * timeout)
    waited = time.monotonic() - started
    assert stalled.is_set() and cleaned.is_set()
    # one line, not the exception through every middleware to uvicorn
    assert [r.getMessage() for r in caplog.records] == [
        "GET / (request id -): the client read nothing for 0.2 s: stream cut off"
    ]
    assert all(r.exc_info is None for r in caplog.records)
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


async def test_a_streams_chunks_skip_the_send_wrappers_of_the_middleware_stack() -> None:
    """The start message passes every layer (the request id header is set on it); the chunks
    after it go to the send the stack was called with, not through each layer's wrapper."""
    inner: list[dict] = []  # what a user middleware's send wrapper saw
    outer: list[dict] = []  # what left the app

    class CountingMiddleware:
        def __init__(self, app) -> None:
            self.app = app

        async def __call__(self, scope, receive, send) -> None:
            async def counted(message: dict) -> None:
                inner.append(message)
                await send(message)

            await self.app(scope, receive, counted)

    config = mock_config(mock_step_ms=1.0)
    app = create_app(config, model=RecordingMock(max_num_seqs=4, step_ms=1.0))
    app.add_middleware(CountingMiddleware)

    async def recorded_app(scope, receive, send) -> None:
        async def recorded(message: dict) -> None:
            outer.append(message)
            await send(message)

        await app(scope, receive, recorded if scope["type"] == "http" else send)

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=recorded_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": "abc", "max_tokens": 24, "stream": True, "ignore_eos": True}
            response = await client.post("/generate", json=body)
    events = parse_sse(response.text)
    assert [name for name, _ in events].count("token") >= 12 and events[-1][0] == "done"
    assert response.headers["x-request-id"]
    chunks = [m for m in outer if m["type"] == "http.response.body" and m.get("body")]
    assert len(chunks) >= 12  # about one a step
    assert [m["type"] for m in inner][0] == "http.response.start"
    wrapped = [m for m in inner if m["type"] == "http.response.body" and m.get("body")]
    assert len(wrapped) <= 1  # (the first may go before the watchdog runs), not one a chunk
