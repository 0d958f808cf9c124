"""Sends one request and records what the client saw of it.

`LoadClient.send` never raises for anything the server or the network does: every request ends
as exactly one `RequestRecord` with an `Outcome`. Only cancellation of the caller propagates.

Streams are read event by event with httpx-sse (`harness.sse.EventStream`), so a cancel can
follow the k-th token. With `Transport.AIOHTTP` the requests go over aiohttp: bursts of hundreds
of requests a second, where httpx's client costs ~3x the CPU per request and falls behind the
arrivals it is meant to measure, and streams, whose bytes aiohttp reads (its C HTTP parser)
while httpx-sse still parses the events (`AiohttpByteStream`): on two cores shared with the
server, httpx's stream reading (httpcore, h11, anyio) cost as much CPU a token as the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import httpx
from harness.sse import EventStream

from loadgen.config import CancelMode, LoadConfig
from loadgen.protocol import (
    Completion,
    Failure,
    StreamItem,
    TextDelta,
    api_format,
    error_type,
)
from loadgen.record import Chunk, Outcome, RequestRecord
from loadgen.workload import RequestSpec

logger = logging.getLogger(__name__)

REJECTING_STATUSES = (429, 503)
# What a malformed answer raises while it is decoded (bad JSON, a list where a dict was due, ...).
MALFORMED_ANSWER = (ValueError, KeyError, TypeError, AttributeError)
TRANSPORT_ERRORS = (httpx.TransportError, aiohttp.ClientError)
JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True, slots=True)
class PlainAnswer:
    """A whole answer: its status, the request id it carries, its body."""

    status: int
    request_id: str | None
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class PlainTransport(Protocol):
    """POSTs one body and reads the whole answer. Raises a `TRANSPORT_ERRORS` on failure."""

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> PlainAnswer: ...


@dataclass(frozen=True, slots=True)
class HttpxPlain:
    http: httpx.AsyncClient

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> PlainAnswer:
        response = await self.http.post(url, content=body, headers=headers)
        return PlainAnswer(
            response.status_code, response.headers.get("x-request-id"), response.content
        )


@dataclass(frozen=True, slots=True)
class AiohttpPlain:
    session: aiohttp.ClientSession

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> PlainAnswer:
        async with self.session.post(url, data=body, headers=headers) as response:
            content = await response.read()
        return PlainAnswer(response.status, response.headers.get("x-request-id"), content)


class AiohttpByteStream(httpx.AsyncByteStream):
    """An aiohttp response's body as httpx's stream, so that httpx-sse parses the events of
    a stream aiohttp reads: each chunk as it arrives."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def aclose(self) -> None:
        self._response.close()


@dataclass(frozen=True, slots=True)
class RunClock:
    """Seconds since the run's start, on the monotonic performance counter."""

    origin: float = field(default_factory=time.perf_counter)

    def now(self) -> float:
        return time.perf_counter() - self.origin


@dataclass(slots=True)
class Attempt:
    """One request in flight: the first terminal event settles it, `record` freezes it."""

    spec: RequestSpec
    streamed: bool
    started_at: float
    chunks: list[Chunk] = field(default_factory=list)
    held_tokens: int = 0  # tokens of events whose text the server held back
    token_ids: list[int] = field(default_factory=list)
    cancel_requested: bool = False
    cancel_confirmed: bool | None = None  # the DELETE's answer: 200 (True) or not
    final_events: int = 0  # `Completion`s and `Failure`s the server sent
    server_request_id: str | None = None
    status: int | None = None
    outcome: Outcome | None = None
    ended_at: float | None = None
    error: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None

    def tokens_received(self) -> int:
        return sum(chunk.tokens for chunk in self.chunks) + self.held_tokens

    def apply(self, item: StreamItem, at: float) -> None:
        match item:
            case TextDelta():
                self.add_text(item, at)
            case Completion():
                self.final_events += 1
                self.complete(item, at)
            case Failure():
                self.final_events += 1
                self.settle(Outcome.ERROR, at, error=item.error)

    def add_text(self, delta: TextDelta, at: float) -> None:
        if self.outcome is not None:
            return
        self.token_ids.extend(delta.token_ids)
        if delta.text:
            self.chunks.append(Chunk(at=at, tokens=delta.tokens + self.held_tokens))
            self.held_tokens = 0
        else:
            self.held_tokens += delta.tokens

    def complete(self, completion: Completion, at: float) -> None:
        cancelled = completion.finish_reason == "cancelled"
        if self.settle(Outcome.CANCELLED if cancelled else Outcome.OK, at):
            self.finish_reason = completion.finish_reason
            self.prompt_tokens = completion.prompt_tokens
            self.output_tokens = completion.output_tokens

    def settle(self, outcome: Outcome, at: float, error: str | None = None) -> bool:
        """Set the outcome once; later terminal events are ignored. True if this one counted."""
        if self.outcome is not None:
            return False
        self.outcome, self.ended_at, self.error = outcome, at, error
        return True

    def record(self, now: float) -> RequestRecord:
        if self.outcome is None:
            self.settle(Outcome.ERROR, now, error="incomplete_stream")
        assert self.outcome is not None and self.ended_at is not None
        output_tokens = self.output_tokens
        return RequestRecord(
            spec=self.spec,
            streamed=self.streamed,
            started_at=self.started_at,
            finished_at=self.ended_at,
            outcome=self.outcome,
            error=self.error,
            status=self.status,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.tokens_received() if output_tokens is None else output_tokens,
            chunks=tuple(self.chunks),
            token_ids=tuple(self.token_ids),
            final_events=self.final_events,
            cancel_confirmed=self.cancel_confirmed,
            server_request_id=self.server_request_id,
        )


class LoadClient:
    """Sends `RequestSpec`s to one server: streams over `http`, or over aiohttp when `plain` is
    `AiohttpPlain` (its session); the rest over `plain`."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        config: LoadConfig,
        clock: RunClock,
        plain: PlainTransport | None = None,
    ) -> None:
        self._http = http
        self._plain = plain or HttpxPlain(http)
        self._session = plain.session if isinstance(plain, AiohttpPlain) else None
        self._clock = clock
        self._format = api_format(config)
        self._base_url = config.url.rstrip("/")
        self._timeout_s = config.timeout_s
        self._send_request_ids = config.send_request_ids
        self._auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    async def send(self, spec: RequestSpec) -> RequestRecord:
        attempt = Attempt(spec=spec, streamed=spec.stream, started_at=self._clock.now())
        try:
            async with asyncio.timeout(self._timeout_s):
                if spec.stream and spec.raw_body is None:
                    await self._send_streaming(attempt)
                else:
                    await self._send_plain(attempt)
        except TimeoutError:
            attempt.settle(Outcome.TRANSPORT_ERROR, self._clock.now(), error="timeout")
        except TRANSPORT_ERRORS as exc:
            error = f"transport {type(exc).__name__}"
            attempt.settle(Outcome.TRANSPORT_ERROR, self._clock.now(), error=error)
        except MALFORMED_ANSWER as exc:
            error = f"bad_response {type(exc).__name__}"
            attempt.settle(Outcome.ERROR, self._clock.now(), error=error)
        return attempt.record(self._clock.now())

    async def _send_plain(self, attempt: Attempt) -> None:
        spec = attempt.spec
        body = spec.raw_body if spec.raw_body is not None else json.dumps(self._format.body(spec))
        answer = await self._plain.post(
            self._base_url + self._format.path,
            body.encode() if isinstance(body, str) else body,
            {**JSON_HEADERS, **self._headers(spec)},
        )
        attempt.server_request_id = answer.request_id
        if not self._accepted(attempt, answer.status, answer.body):
            return
        delta, completion = self._format.decode_response(answer.json())
        now = self._clock.now()
        attempt.final_events += 1
        attempt.add_text(delta, now)
        attempt.complete(completion, now)

    async def _send_streaming(self, attempt: Attempt) -> None:
        if self._session is not None:
            await self._send_streaming_aiohttp(attempt, self._session)
            return
        deletes: list[asyncio.Task[None]] = []
        try:
            async with self._http.stream(
                "POST",
                self._base_url + self._format.path,
                json=self._format.body(attempt.spec),
                headers=self._headers(attempt.spec),
            ) as response:
                attempt.server_request_id = response.headers.get("x-request-id")
                body = b"" if response.status_code == 200 else await response.aread()
                if self._accepted(attempt, response.status_code, body):
                    await self._read_stream(attempt, EventStream(response), deletes)
        finally:
            await asyncio.gather(*deletes)  # _delete never raises

    async def _send_streaming_aiohttp(
        self, attempt: Attempt, session: aiohttp.ClientSession
    ) -> None:
        deletes: list[asyncio.Task[None]] = []
        try:
            async with session.post(
                self._base_url + self._format.path,
                data=json.dumps(self._format.body(attempt.spec)).encode(),
                headers={**JSON_HEADERS, **self._headers(attempt.spec)},
            ) as answer:
                attempt.server_request_id = answer.headers.get("x-request-id")
                body = b"" if answer.status == 200 else await answer.read()
                if not self._accepted(attempt, answer.status, body):
                    return
                # Only what httpx-sse reads: aiohttp has already undone any Content-Encoding.
                headers = {"content-type": answer.headers.get("content-type", "")}
                if attempt.server_request_id is not None:
                    headers["x-request-id"] = attempt.server_request_id
                response = httpx.Response(
                    answer.status, headers=headers, stream=AiohttpByteStream(answer)
                )
                stream = EventStream(response)
                try:
                    await self._read_stream(attempt, stream, deletes)
                finally:
                    await stream.aclose()  # a disconnect on purpose: the connection goes
        finally:
            await asyncio.gather(*deletes)  # _delete never raises

    async def _read_stream(
        self, attempt: Attempt, stream: EventStream, deletes: list[asyncio.Task[None]]
    ) -> None:
        """Read events to the end of the stream, or until the client disconnects on purpose."""
        decoder = self._format.stream_decoder()
        async for event in stream:
            now = self._clock.now()
            for item in decoder.decode(event):
                attempt.apply(item, now)
            if not self._cancel_due(attempt):
                continue
            attempt.cancel_requested = True
            if attempt.spec.cancel_mode is CancelMode.DISCONNECT:
                attempt.settle(Outcome.CANCELLED, now)
                return  # leaving the `async with` closes the connection mid-stream
            deletes.append(asyncio.create_task(self._delete(attempt)))

    def _cancel_due(self, attempt: Attempt) -> bool:
        after_tokens = attempt.spec.cancel_after_tokens
        return (
            after_tokens is not None
            and not attempt.cancel_requested
            and attempt.outcome is None
            and attempt.tokens_received() >= after_tokens
        )

    async def _delete(self, attempt: Attempt) -> None:
        """DELETE /generate/{id}; the stream then ends with finish_reason "cancelled" (or, on a
        404, the request had already finished and ends as it was going to)."""
        request_id = attempt.server_request_id or attempt.spec.request_id
        try:
            response = await self._http.delete(
                f"{self._base_url}/generate/{request_id}", headers=self._auth
            )
        except httpx.TransportError as exc:
            logger.warning("DELETE %s failed: %s", request_id, type(exc).__name__)
            return
        attempt.cancel_confirmed = response.status_code == 200
        if response.status_code not in (200, 404):
            logger.warning("DELETE %s answered %d", request_id, response.status_code)

    def _accepted(self, attempt: Attempt, status: int, body: bytes) -> bool:
        """Record the status; settle a non-200 as rejected or error. True for a 200."""
        attempt.status = status
        if status == 200:
            return True
        outcome = Outcome.REJECTED if status in REJECTING_STATUSES else Outcome.ERROR
        error = f"{status} {error_type(json_or_none(body))}"
        attempt.settle(outcome, self._clock.now(), error=error)
        return False

    def _headers(self, spec: RequestSpec) -> dict[str, str]:
        if not self._send_request_ids:
            return dict(self._auth)
        return {"X-Request-Id": spec.request_id, **self._auth}


def json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None
