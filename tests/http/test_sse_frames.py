"""``json_event`` frames an event exactly as sse-starlette frames the stdlib's compact JSON."""

from __future__ import annotations

import json
import random

import pytest
from sse_starlette import ServerSentEvent

from app.api.native_answer import NativeAnswer
from app.api.sse_frames import encoded, json_event
from app.engine.request import TokenEvent
from app.models.base import TokenLogprobs

# the characters JSON escapes or SSE splits lines on, multi-byte ones, and plain text
PIECES = [
    '"',
    "\\",
    "\n",
    "\r",
    "\r\n",
    "\t",
    "\x00",
    "\x1f",
    "\x7f",
    "\u2028",
    "é",
    "中",
    "😀",
    "a b",
    "/",
]


def _stdlib(payload: dict, event: str | None, sep: str) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(data=data, event=event, sep=sep).encode()


@pytest.mark.parametrize("sep", ["\r\n", "\n"])
@pytest.mark.parametrize("event", [None, "token", "content_block_delta"])
def test_the_same_bytes_as_sse_starlette_with_the_stdlib(event: str | None, sep: str) -> None:
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        payload = {
            "id": "req-1",
            "text": text,
            "token_ids": [rng.randint(0, 2**31) for _ in range(rng.randint(0, 3))],
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None}],
            "flag": rng.random() < 0.5,
            "big": 10**30,  # past 64 bits: orjson refuses it, the stdlib writes it
        }
        if rng.random() < 0.5:
            del payload["big"]
        assert json_event(payload, event=event, sep=sep) == _stdlib(payload, event, sep)


def test_a_chunk_mixes_framed_events_and_event_objects() -> None:
    framed = json_event({"a": 1}, event="token")
    other = ServerSentEvent(data="x", event="done")
    assert encoded([framed, other, framed]) == framed + other.encode() + framed


def test_every_native_event_is_compact_json() -> None:
    # the framed token events and those that keep the event object (logprobs) are written alike
    plain = NativeAnswer("req-1")
    with_logprobs = NativeAnswer("req-2", logprobs=True)
    event = TokenEvent("é x", (7, 8), (TokenLogprobs(7, -0.5, ((7, -0.5),)),) * 2)
    for answer in (plain, with_logprobs):
        (chunk,) = answer.token(event)
        data = encoded([chunk]).decode().split("\r\n")[1].removeprefix("data: ")
        assert data == json.dumps(json.loads(data), ensure_ascii=False, separators=(",", ":"))
