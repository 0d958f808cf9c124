"""The ceiling of the HTTP layer: a bare Starlette app on uvicorn that answers ``POST /generate``
with the same Server-Sent Events the real server sends, and no engine, model or validation.

    python scripts/bench_sse_ceiling.py --port 8100     # this app, on uvicorn
    python scripts/load.py --url http://127.0.0.1:8100 --concurrency 16 --num-requests 64 \\
        --output-len 256 --ignore-eos      # same client, same events, no server work

Two endpoints, so a benchmark can tell the SSE library's cost from the engine's:

- ``/generate``: Starlette's ``StreamingResponse`` over an async generator of pre-framed bytes;
- ``/sse-starlette/generate``: ``sse_starlette.EventSourceResponse`` with the server's settings
  (ping interval, send timeout), as ``app/api/generate.py`` uses it.

Each answer is ``event: token`` events (``{"id", "text", "token_ids"}``, compact JSON as the
server writes them) carrying exactly
``max_tokens`` tokens, then one ``event: done`` (``{"id", "finish_reason": "length", ...}``),
framed with ``\\r\\n`` like sse_starlette. The text cycles through the mock model's alphabet with
one event per character, so a multi-byte character is one event with several token ids, as the
mock's detokenizer sends it: events per token match the mock's. Between two events the generator
yields to the event loop, as a server that streams many requests at once must.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Iterator

import orjson
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# The mock model's alphabet (app/models/mock.py): 34 one-byte characters and 5 multi-byte ones.
ALPHABET = tuple("abcdefghijklmnopqrstuvwxyz      .,éß中文😀")
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PING_INTERVAL_S = 15.0
SEND_TIMEOUT_S = 30.0


def token_payloads(request_id: str, max_tokens: int) -> Iterator[dict[str, object]]:
    """The ``token`` events' data: ``max_tokens`` byte tokens, one character per event."""
    sent = 0
    index = 0
    while sent < max_tokens:
        char = ALPHABET[index % len(ALPHABET)]
        token_ids = list(char.encode("utf-8"))[: max_tokens - sent]
        text = char if len(token_ids) == len(char.encode("utf-8")) else ""
        sent += len(token_ids)
        index += 1
        yield {"id": request_id, "text": text, "token_ids": token_ids}


def done_payload(request_id: str, max_tokens: int, prompt_tokens: int) -> dict[str, object]:
    return {
        "id": request_id,
        "finish_reason": "length",
        "stop_reason": None,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens},
        "timings": {"queued_ms": 0.0, "ttft_ms": 0.0, "total_ms": 0.0},
    }


def frame(event: str, data: dict[str, object]) -> bytes:
    """One SSE event as the server frames it (``app.api.sse_frames.json_event``: orjson's
    compact JSON; before 2026-12-06 the stdlib's, as the server then wrote it)."""
    return b"event: " + event.encode() + b"\r\ndata: " + orjson.dumps(data) + b"\r\n\r\n"


async def read_request(request: Request) -> tuple[str, int, int]:
    """(request id, max_tokens, prompt tokens) of a ``/generate`` body; byte-level prompt count."""
    body = json.loads(await request.body() or b"{}")
    request_id = request.headers.get("x-request-id") or secrets.token_hex(16)
    prompt = str(body.get("prompt", ""))
    return request_id, int(body.get("max_tokens", 128)), len(prompt.encode("utf-8"))


async def bare_events(request_id: str, max_tokens: int, prompt_tokens: int) -> AsyncIterator[bytes]:
    for payload in token_payloads(request_id, max_tokens):
        yield frame("token", payload)
        await asyncio.sleep(0)
    yield frame("done", done_payload(request_id, max_tokens, prompt_tokens))


async def sse_events(
    request_id: str, max_tokens: int, prompt_tokens: int
) -> AsyncIterator[ServerSentEvent]:
    for payload in token_payloads(request_id, max_tokens):
        yield ServerSentEvent(data=orjson.dumps(payload).decode(), event="token")
        await asyncio.sleep(0)
    done = done_payload(request_id, max_tokens, prompt_tokens)
    yield ServerSentEvent(data=json.dumps(done), event="done")


async def generate_bare(request: Request) -> Response:
    request_id, max_tokens, prompt_tokens = await read_request(request)
    return StreamingResponse(
        bare_events(request_id, max_tokens, prompt_tokens),
        media_type="text/event-stream",
        headers={**HEADERS, "X-Request-Id": request_id},
    )


async def generate_sse_starlette(request: Request) -> Response:
    request_id, max_tokens, prompt_tokens = await read_request(request)
    return EventSourceResponse(
        sse_events(request_id, max_tokens, prompt_tokens),
        ping=PING_INTERVAL_S,
        send_timeout=SEND_TIMEOUT_S,
        headers={**HEADERS, "X-Request-Id": request_id},
    )


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def create_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/generate", generate_bare, methods=["POST"]),
            Route("/sse-starlette/generate", generate_sse_starlette, methods=["POST"]),
            Route("/health", health),
        ]
    )
