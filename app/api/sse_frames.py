"""The events a stream sends for every token, framed as bytes in one step.

A streamed answer's formats yield sse-starlette ``ServerSentEvent`` objects, which
:func:`encoded` frames. For the few events a stream sends once per token (a native
``token`` event, an OpenAI chunk without logprobs, Anthropic's events) that
was most of the per-token work of the HTTP side: the stdlib ``json.dumps`` (~2.3 us), the event
object and its line-splitting ``encode`` (~1.3 us). :func:`json_event` writes the same event
with orjson (~0.1 us) and frames it directly (the JSON has no line break, so its ``data`` is one
line). Measured with ``scripts/bench.py --scenarios 2`` (the mock at 0 ms, 16 SSE streams) on
the 2-core AMX Xeon, alternating runs against the same ceiling (which frames with orjson too):
21.5-23.3k tok/s before, 27.3-29.6k after; 42-44% of the bare Starlette ceiling before, 52-55%
after.

The JSON is compact (no spaces after separators), as OpenAI and Anthropic write theirs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import orjson
from sse_starlette import ServerSentEvent

SSEEvent = ServerSentEvent | bytes  # what a format yields: an event, or one framed already


def compact_json(payload: object) -> str:
    """The stdlib's compact JSON of ``payload`` (no spaces, non-ASCII as itself): what every
    SSE event's data is, as OpenAI and Anthropic write theirs; for events that can carry floats
    (orjson writes a NaN or an infinity as ``null``) and what orjson refuses."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def json_event(payload: dict[str, object], *, event: str | None = None, sep: str = "\r\n") -> bytes:
    """``payload`` as one SSE event: the bytes ``ServerSentEvent(data=<compact JSON>,
    event=event, sep=sep).encode()`` gives.

    Args:
        payload: dicts, lists, strings, ints, bools and None only. Not for floats: orjson writes
            a NaN or an infinity (a logprob of a masked token) as ``null``, where the stdlib
            writes ``NaN`` / ``-Infinity``; events that can carry logprobs keep
            ``ServerSentEvent`` and the stdlib.
        event: the event's name (an ``event:`` line), or None for a ``data:``-only event.
        sep: the line end (sse-starlette's default ``\\r\\n``; OpenAI's ``\\n``).

    Raises:
        UnicodeEncodeError: a string with a lone surrogate (as ``encode`` raises it).
    """
    try:
        data = orjson.dumps(payload)
    except orjson.JSONEncodeError:  # what orjson refuses (an int past 64 bits): the stdlib's
        data = compact_json(payload).encode()
    line_end = sep.encode()
    head = b"data: " if event is None else b"event: " + event.encode() + line_end + b"data: "
    return head + data + line_end + line_end


def encoded(events: Iterable[SSEEvent]) -> bytes:
    """Events as one chunk: each framed as sse-starlette frames it (its own separator), or as
    :func:`json_event` framed it."""
    return b"".join(e if type(e) is bytes else e.encode() for e in events)  # type: ignore[union-attr]
