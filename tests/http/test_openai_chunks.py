"""A stream's common chunk (text, or reasoning, without logprobs) is written as a plain dict
(``_OpenAIAnswer._plain_chunk``, framed by ``json_event``): the same event, byte for byte, as
the pydantic models' JSON in a ``ServerSentEvent``."""

from __future__ import annotations

import pytest

from app.api.openai.answers import ChatAnswer, CompletionAnswer, data_event
from app.api.openai.responses import ChatChunkChoice, ChatDelta, CompletionChoice
from app.api.reasoning import ReasoningSplitter
from app.api.sse_frames import encoded
from app.engine.request import TokenEvent

TEXTS = ["a", " Paris", 'quote " and \\ backslash', "é ✓ 中文 \U0001f600", "line\nbreak\t"]


@pytest.mark.parametrize("text", TEXTS)
def test_a_completion_chunk_is_the_models_json(text: str) -> None:
    answer = CompletionAnswer(id="cmpl-7", created=1_700_000_000, model="smol", index=2)
    (event,) = answer.token(TokenEvent(text, (5,)))
    choice = CompletionChoice(index=2, text=text, logprobs=None, finish_reason=None)
    assert encoded([event]) == data_event(answer._chunk([choice])).encode()


@pytest.mark.parametrize("text", TEXTS)
def test_a_chat_content_chunk_is_the_models_json(text: str) -> None:
    answer = ChatAnswer(id="chatcmpl-7", created=1_700_000_000, model="smol", index=1)
    (event,) = answer.token(TokenEvent(text, (5,)))
    choice = ChatChunkChoice(index=1, delta=ChatDelta(content=text), finish_reason=None)
    assert encoded([event]) == data_event(answer._chunk([choice])).encode()


def test_a_chat_reasoning_chunk_is_the_models_json() -> None:
    answer = ChatAnswer(
        id="chatcmpl-8", created=3, model="qwen", reasoning=ReasoningSplitter(inside=True)
    )
    (event,) = answer.token(TokenEvent("thinking… ", (5,)))
    delta = ChatDelta(reasoning_content="thinking… ")
    choice = ChatChunkChoice(index=0, delta=delta, finish_reason=None)
    assert encoded([event]) == data_event(answer._chunk([choice])).encode()
