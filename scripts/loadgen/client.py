"""Sends one request and records what the client saw of it.

`LoadClient.send` never raises for anything the server or the network does: every request ends
as exactly one `RequestRecord` with an `Outcome`. Only cancellation of the caller propagates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadgen.config import CancelMode, LoadConfig
from loadgen.protocol import (
    Completion,
    Failure,
    SseDecoder,
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
    cancel_requested: bool = False
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
                self.complete(item, at)
            case Failure():
                self.settle(Outcome.ERROR, at, error=item.error)

    def add_text(self, delta: TextDelta, at: float) -> None:
        if self.outcome is not None:
            return
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
        )


class LoadClient:
    """Sends `RequestSpec`s to one server over a shared `httpx.AsyncClient`."""

    def __init__(self, http: httpx.AsyncClient, config: LoadConfig, clock: RunClock) -> None:
        self._http = http
        self._clock = clock
        self._format = api_format(config)
        self._base_url = config.url.rstrip("/")
        self._timeout_s = config.timeout_s
        self._stream = config.workload.stream
        self._cancel_mode = config.workload.cancel.mode
        self._auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    async def send(self, spec: RequestSpec) -> RequestRecord:
        attempt = Attempt(spec=spec, streamed=self._stream, started_at=self._clock.now())
        try:
            async with asyncio.timeout(self._timeout_s):
                if self._stream:
                    await self._send_streaming(attempt)
                else:
                    await self._send_plain(attempt)
        except TimeoutError:
            attempt.settle(Outcome.TRANSPORT_ERROR, self._clock.now(), error="timeout")
        except httpx.TransportError as exc:
            error = f"transport {type(exc).__name__}"
            attempt.settle(Outcome.TRANSPORT_ERROR, self._clock.now(), error=error)
        except MALFORMED_ANSWER as exc:
            error = f"bad_response {type(exc).__name__}"
            attempt.settle(Outcome.ERROR, self._clock.now(), error=error)
        return attempt.record(self._clock.now())

    async def _send_plain(self, attempt: Attempt) -> None:
        response = await self._http.post(
            self._base_url + self._format.path,
            json=self._format.body(attempt.spec),
            headers=self._headers(attempt.spec),
        )
        if not self._accepted(attempt, response):
            return
        delta, completion = self._format.decode_response(response.json())
        now = self._clock.now()
        attempt.add_text(delta, now)
        attempt.complete(completion, now)

    async def _send_streaming(self, attempt: Attempt) -> None:
        deletes: list[asyncio.Task[None]] = []
        try:
            async with self._http.stream(
                "POST",
                self._base_url + self._format.path,
                json=self._format.body(attempt.spec),
                headers=self._headers(attempt.spec),
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                if self._accepted(attempt, response):
                    await self._read_stream(attempt, response, deletes)
        finally:
            await asyncio.gather(*deletes)  # _delete never raises

    async def _read_stream(
        self, attempt: Attempt, response: httpx.Response, deletes: list[asyncio.Task[None]]
    ) -> None:
        """Read events to the end of the stream, or until the client disconnects on purpose."""
        sse = SseDecoder()
        decoder = self._format.stream_decoder()
        async for line in response.aiter_lines():
            event = sse.feed(line)
            if event is None:
                continue
            now = self._clock.now()
            for item in decoder.decode(event):
                attempt.apply(item, now)
            if not self._cancel_due(attempt):
                continue
            attempt.cancel_requested = True
            if self._cancel_mode is CancelMode.DISCONNECT:
                attempt.settle(Outcome.CANCELLED, now)
                return  # leaving the `async with` closes the connection mid-stream
            deletes.append(asyncio.create_task(self._delete(attempt.spec.request_id)))

    def _cancel_due(self, attempt: Attempt) -> bool:
        after_tokens = attempt.spec.cancel_after_tokens
        return (
            after_tokens is not None
            and not attempt.cancel_requested
            and attempt.outcome is None
            and attempt.tokens_received() >= after_tokens
        )

    async def _delete(self, request_id: str) -> None:
        """DELETE /generate/{id}; the stream then ends with finish_reason "cancelled" (or, on a
        404, the request had already finished and ends as it was going to)."""
        try:
            response = await self._http.delete(
                f"{self._base_url}/generate/{request_id}", headers=self._auth
            )
        except httpx.TransportError as exc:
            logger.warning("DELETE %s failed: %s", request_id, type(exc).__name__)
            return
        if response.status_code not in (200, 404):
            logger.warning("DELETE %s answered %d", request_id, response.status_code)

    def _accepted(self, attempt: Attempt, response: httpx.Response) -> bool:
        """Record the status; settle a non-200 as rejected or error. True for a 200."""
        attempt.status = response.status_code
        if response.status_code == 200:
            return True
        outcome = Outcome.REJECTED if response.status_code in REJECTING_STATUSES else Outcome.ERROR
        error = f"{response.status_code} {error_type(json_or_none(response))}"
        attempt.settle(outcome, self._clock.now(), error=error)
        return False

    def _headers(self, spec: RequestSpec) -> dict[str, str]:
        return {"X-Request-Id": spec.request_id, **self._auth}


def json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None
