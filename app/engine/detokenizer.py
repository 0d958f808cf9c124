"""Incremental detokenisation with stop strings.

Tokens arrive as raw bytes (a byte-level tokenizer may split one UTF-8 character over several
tokens). ``TextAssembler`` turns them into text that is safe to hand to a client at every step:

* never part of a UTF-8 character: the stdlib incremental UTF-8 decoder keeps the bytes of an
  unfinished character until the rest arrives (invalid bytes become U+FFFD, as in every server);
* never text that could still become a stop string: the longest suffix of the text that is a
  prefix of some stop string is held back until the next token decides it;
* never the stop string itself, nor anything after it: on a match the text is cut where the
  earliest match starts.

Why a match can never start inside text already released: whatever was released was not part of
the longest suffix that could start a stop string, so no stop string can begin there.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextAssembler:
    """Builds one request's output text from token bytes.

    Only the text not yet released is kept as one string (the held-back suffix: a part of a
    character, or what could still start a stop string); released text is kept as its
    chunks, joined when ``text`` is read. So a token costs the same at the end of a long
    output as at its start (appending to the whole text copied it every token).

    Args:
        stop_strings: strings that end generation; each non-empty.

    Attributes:
        matched_stop: the stop string that ended the text, or None.
    """

    __slots__ = ("_decoder", "_stop_strings", "_released", "_pending", "matched_stop")

    def __init__(self, stop_strings: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop_strings = tuple(stop_strings)
        self._released: list[str] = []  # the chunks released so far, in order
        self._pending = ""  # decided text not released yet (a stop string's possible start)
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """All text decided so far (released and held back), stop string excluded."""
        return "".join(self._released) + self._pending

    def append(self, data: bytes) -> str:
        """Adds one token's bytes; returns the text that became safe to release (may be "").

        After a stop string matched, further calls are a programming error.
        """
        if self.matched_stop is not None:
            raise RuntimeError("text already ended by a stop string")
        self._pending += self._decoder.decode(data)
        if not self._stop_strings:
            return self._release(len(self._pending))
        match = self._earliest_stop_match()
        if match is not None:
            start, stop = match
            self._pending = self._pending[:start]
            self.matched_stop = stop
            return self._release(start)
        return self._release(len(self._pending) - self._undecided_suffix_length())

    def flush(self) -> str:
        """Releases everything held back (generation ended without a stop string).

        Bytes of a character that never completed are dropped, never shown as U+FFFD.
        """
        return self._release(len(self._pending))

    def _release(self, end: int) -> str:
        """Releases the first ``end`` characters of the held-back text."""
        if end <= 0:
            return ""
        chunk = self._pending[:end]
        self._pending = self._pending[end:]
        self._released.append(chunk)
        return chunk

    def _earliest_stop_match(self) -> tuple[int, str] | None:
        """The earliest stop string in the held-back text (none can start in released text)."""
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            start = self._pending.find(stop)
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _undecided_suffix_length(self) -> int:
        """Length of the longest suffix of the held-back text that begins some stop string."""
        pending = self._pending
        longest = 0
        for stop in self._stop_strings:
            for length in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest
