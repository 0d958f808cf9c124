"""The input reader: lines across chunk boundaries, the last line without a line end, overlong
lines counted and not kept, a read-ahead bounded by its chunks, read errors after the lines
before them."""

from __future__ import annotations

import io
import threading

import pytest
from harness.wait import wait_for

from app.batch.reader import InputError, InputLine, LineReader, OverlongLine


async def read_all(reader: LineReader) -> list[InputLine | OverlongLine]:
    return [line async for line in reader.lines()]


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 64 * 1024])
async def test_lines_are_split_the_same_whatever_the_chunks(chunk_bytes):
    data = b'{"a": 1}\n\n{"b": "\xc3\xa9"}\r\nlast without end'
    reader = LineReader(io.BytesIO(data), name="in", max_line_bytes=100, chunk_bytes=chunk_bytes)
    assert await read_all(reader) == [
        InputLine(1, b'{"a": 1}'),
        InputLine(2, b""),
        InputLine(3, b'{"b": "\xc3\xa9"}\r'),
        InputLine(4, b"last without end"),
    ]


async def test_an_overlong_line_is_counted_not_kept_and_the_next_ones_are_read():
    data = b"short\n" + b"x" * 50 + b"\n" + b"y" * 11 + b"\nok"
    reader = LineReader(io.BytesIO(data), name="in", max_line_bytes=10, chunk_bytes=4)
    assert await read_all(reader) == [
        InputLine(1, b"short"),
        OverlongLine(2, 50),
        OverlongLine(3, 11),
        InputLine(4, b"ok"),
    ]


async def test_an_empty_input_has_no_lines():
    assert await read_all(LineReader(io.BytesIO(b""), name="in", max_line_bytes=10)) == []


class CountingStream(io.RawIOBase):
    """One 10-byte line per ``read1`` of 10 bytes; counts the reads (thread-safe)."""

    def __init__(self, lines: int) -> None:
        self.remaining = lines
        self.reads = 0
        self.lock = threading.Lock()

    def readable(self) -> bool:
        return True

    def read1(self, size: int = -1) -> bytes:
        with self.lock:
            self.reads += 1
            if self.remaining == 0:
                return b""
            self.remaining -= 1
            return b"123456789\n"


async def test_the_reader_runs_only_chunks_ahead_of_its_consumer():
    stream = CountingStream(lines=40)
    chunks_ahead = 3
    reader = LineReader(stream, name="in", max_line_bytes=100, chunk_bytes=10, chunks_ahead=3)
    taken = 0
    most_ahead = 0
    async for _ in reader.lines():
        taken += 1
        # let the thread read as far as it may, then check it stopped there
        allowed = min(taken + chunks_ahead, 41)  # 40 lines and the read that finds the end
        await wait_for(lambda bound=allowed: stream.reads >= bound, what="read-ahead")
        most_ahead = max(most_ahead, stream.reads - taken)
        if taken == 20:
            break  # a consumer that stops early: the thread ends instead of reading on
    assert most_ahead == chunks_ahead
    reads_when_stopped = stream.reads
    assert reads_when_stopped <= 20 + chunks_ahead + 1


class FailingStream(io.RawIOBase):
    def __init__(self) -> None:
        self.calls = 0

    def readable(self) -> bool:
        return True

    def read1(self, size: int = -1) -> bytes:
        self.calls += 1
        if self.calls == 1:
            return b"one\ntwo\n"
        raise OSError(5, "Input/output error")


async def test_a_read_error_comes_after_the_lines_read_before_it():
    reader = LineReader(FailingStream(), name="in.jsonl", max_line_bytes=100)
    lines = []
    with pytest.raises(InputError, match="cannot read in.jsonl: Input/output error"):
        async for line in reader.lines():
            lines.append(line)
    assert lines == [InputLine(1, b"one"), InputLine(2, b"two")]
