"""OpenAI's batch output lines, and the buffer that puts them back into input order.

Each input line gives one output line, ``{"id", "custom_id", "response", "error"}``:

- a request the endpoint answered, successfully or not: ``response`` is ``{"status_code",
  "request_id", "body"}`` with the endpoint's body (an error body for a 4xx/5xx, as OpenAI
  writes them into its error file), and ``error`` is null;
- a line that could not be run (``app.batch.requests``): ``response`` is null, ``error`` is
  ``{"code", "message", "line", "param"}`` (OpenAI's per-line error with the line and field of
  its batch validation errors).

Requests finish out of order; ``ReorderBuffer`` holds the ones that finished before an earlier
line did and releases them in input order. It holds at most ``capacity`` lines (in flight or
finished), and the producer waits for room, so the read-ahead is bounded by the same number.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from app.batch.endpoints import EndpointAnswer
from app.batch.requests import LineError


@dataclass(frozen=True, slots=True)
class Answered:
    """An input line the endpoint answered."""

    line: int
    custom_id: str
    answer: EndpointAnswer


LineResult = Answered | LineError


def output_line(result: LineResult) -> dict[str, object]:
    """The OpenAI batch output object of one input line (see the module doc)."""
    if isinstance(result, Answered):
        answer = result.answer
        return {
            "id": f"batch_req_{answer.request_id}",
            "custom_id": result.custom_id,
            "response": {
                "status_code": answer.status_code,
                "request_id": answer.request_id,
                "body": answer.body,
            },
            "error": None,
        }
    return {
        "id": f"batch_req_{secrets.token_hex(16)}",
        "custom_id": result.custom_id,
        "response": None,
        "error": {
            "code": result.code,
            "message": result.message,
            "line": result.line,
            "param": result.param,
        },
    }


def encode_line(result: LineResult) -> bytes:
    """One JSONL line (UTF-8, ``\\n``-terminated); a lone surrogate in a client's string (a
    ``\\ud800`` escape in its custom_id) is written as an escape, not as invalid UTF-8."""
    line = output_line(result)
    try:
        text = json.dumps(line, ensure_ascii=False)
        return (text + "\n").encode()
    except UnicodeEncodeError:
        return (json.dumps(line) + "\n").encode()


class ReorderBuffer:
    """Results in input order, at most ``capacity`` held (see the module doc). One producer
    ``add`` s in input order, then ``close`` s; one consumer iterates ``in_order``.

    Args:
        capacity: most lines added but not yet taken by the consumer (>= 1).
    """

    def __init__(self, capacity: int) -> None:
        self._pending: deque[asyncio.Future[LineResult]] = deque()
        self._room = asyncio.Semaphore(capacity)
        self._changed = asyncio.Event()
        self._closed = False

    def __len__(self) -> int:
        return len(self._pending)

    async def wait_for_room(self) -> None:
        """Returns once one more line may be added (call once per ``add``)."""
        await self._room.acquire()

    def add(self, result: asyncio.Task[Answered] | LineResult) -> None:
        """The next line's result: already known, or the task that will have it (it must not
        raise). Call ``wait_for_room`` first."""
        future: asyncio.Future[LineResult]
        if isinstance(result, asyncio.Task):
            future = result  # type: ignore[assignment]
        else:
            future = asyncio.get_running_loop().create_future()
            future.set_result(result)
        self._pending.append(future)
        self._changed.set()

    def close(self) -> None:
        """No more lines: ``in_order`` ends after the last one."""
        self._closed = True
        self._changed.set()

    @property
    def head_is_ready(self) -> bool:
        """Whether the next result in order is known (the consumer may write without waiting)."""
        return bool(self._pending) and self._pending[0].done()

    async def in_order(self) -> AsyncIterator[LineResult]:
        """Each result in input order as soon as it and every earlier one are known."""
        while True:
            while not self._pending:
                if self._closed:
                    return
                self._changed.clear()
                await self._changed.wait()
            result = await self._pending[0]
            self._pending.popleft()
            self._room.release()
            yield result

    def cancel(self) -> None:
        """Cancels every result still being made (the run is being abandoned)."""
        for future in self._pending:
            future.cancel()
