"""The input, read on its own thread and handed to the event loop a chunk of lines at a time.

A batch file may have millions of lines, and standard input may come from a slow producer, so
the input is never read whole and a read never blocks the event loop (whose engine keeps the
requests already read moving meanwhile). The thread reads what the stream has
(``read1``, at most ``chunk_bytes``), splits it into lines and hands them over; it reads the next
chunk only once the loop has taken one of the last ``chunks_ahead``. So at most
``(chunks_ahead + 1) * chunk_bytes`` bytes of lines, plus one unfinished line of at most
``max_line_bytes``, are in memory ahead of the consumer. A longer line is counted, not kept:
it arrives as an ``OverlongLine``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import BinaryIO

CHUNK_BYTES = 64 * 1024
CHUNKS_AHEAD = 4


@dataclass(frozen=True, slots=True)
class InputLine:
    """One line of the input.

    Attributes:
        number: its 1-based line number in the input.
        data: its bytes, without the ``\\n``.
    """

    number: int
    data: bytes


@dataclass(frozen=True, slots=True)
class OverlongLine:
    """A line longer than the reader keeps; ``size`` is its length in bytes (no ``\\n``)."""

    number: int
    size: int


class InputError(Exception):
    """The input could not be read; the message names it and the reason."""


@dataclass(frozen=True, slots=True)
class _Failed:
    message: str


_END = object()


class _LineSplitter:
    """Splits a byte stream into lines, keeping at most ``max_line_bytes`` of an unfinished one
    (owned by the reading thread)."""

    def __init__(self, max_line_bytes: int) -> None:
        self._max_line_bytes = max_line_bytes
        self._partial = bytearray()
        self._size = 0  # of the unfinished line, its dropped bytes included
        self._number = 0

    def feed(self, data: bytes) -> list[InputLine | OverlongLine]:
        lines: list[InputLine | OverlongLine] = []
        start = 0
        view = memoryview(data)
        while (end := data.find(b"\n", start)) >= 0:
            self._extend(view[start:end])
            lines.append(self._take_line())
            start = end + 1
        self._extend(view[start:])
        return lines

    def finish(self) -> list[InputLine | OverlongLine]:
        """The last line, when the input does not end with ``\\n``."""
        return [self._take_line()] if self._size else []

    def _extend(self, piece: memoryview) -> None:
        self._size += len(piece)
        if self._size <= self._max_line_bytes:
            self._partial += piece
        elif self._partial:
            self._partial = bytearray()  # over the limit: counted from now on, not kept

    def _take_line(self) -> InputLine | OverlongLine:
        self._number += 1
        line: InputLine | OverlongLine
        if self._size > self._max_line_bytes:
            line = OverlongLine(self._number, self._size)
        else:
            line = InputLine(self._number, bytes(self._partial))
        self._partial = bytearray()
        self._size = 0
        return line


class LineReader:
    """Reads ``stream`` on a daemon thread (see the module doc for the memory bound).

    Args:
        stream: a binary stream (a file opened ``rb``, ``sys.stdin.buffer``); not closed here.
        name: names it in error messages (its path, or ``standard input``).
        max_line_bytes: longer lines arrive as ``OverlongLine``.
        chunk_bytes / chunks_ahead: how much one read takes, how many reads may wait.
    """

    def __init__(
        self,
        stream: BinaryIO,
        *,
        name: str,
        max_line_bytes: int,
        chunk_bytes: int = CHUNK_BYTES,
        chunks_ahead: int = CHUNKS_AHEAD,
    ) -> None:
        self._stream = stream
        self._name = name
        self._max_line_bytes = max_line_bytes
        self._chunk_bytes = chunk_bytes
        self._chunks_ahead = chunks_ahead

    async def lines(self) -> AsyncIterator[InputLine | OverlongLine]:
        """Every line, in order, as the thread reads them. One iteration per reader.

        Raises:
            InputError: reading failed (the lines before it have been yielded).
        """
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[object] = asyncio.Queue()
        permits = threading.Semaphore(self._chunks_ahead)
        stop = threading.Event()
        thread = threading.Thread(
            target=self._read,
            args=(loop, chunks, permits, stop),
            name="batch-input",
            daemon=True,  # a read blocked on a silent pipe must not keep the process alive
        )
        thread.start()
        try:
            while True:
                item = await chunks.get()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise InputError(item.message)
                permits.release()
                assert isinstance(item, list)
                for line in item:
                    yield line
        finally:
            stop.set()
            permits.release()  # wakes the thread if it waits for room, so that it ends

    def _read(
        self,
        loop: asyncio.AbstractEventLoop,
        chunks: asyncio.Queue[object],
        permits: threading.Semaphore,
        stop: threading.Event,
    ) -> None:
        def hand_over(item: object) -> bool:
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody reads any more
                return False
            return True

        read = getattr(self._stream, "read1", self._stream.read)
        splitter = _LineSplitter(self._max_line_bytes)
        try:
            while True:
                permits.acquire()
                if stop.is_set():
                    return
                data = read(self._chunk_bytes)
                if not data:
                    hand_over(splitter.finish())
                    hand_over(_END)
                    return
                if not hand_over(splitter.feed(data)):
                    return
        except (OSError, ValueError) as exc:  # ValueError: the stream was closed under us
            hand_over(_Failed(f"cannot read {self._name}: {getattr(exc, 'strerror', None) or exc}"))
