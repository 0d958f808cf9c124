"""The two wire formats the client speaks, turned into the same small items.

A server's answer becomes a sequence of `TextDelta`s ended by one `Completion` or one `Failure`,
whichever API produced it:

- native: POST /generate; stream `event: token` {text, token_ids}, `event: done` {finish_reason,
  usage}, `event: error` {error: {type, ...}}; non-stream {text, finish_reason, usage}.
- openai: POST /v1/completions; stream `data: {"choices": [{"text", "finish_reason"}], "usage"}`
  chunks then `data: [DONE]` (usage arrives in a chunk with empty choices when the server honours
  `stream_options.include_usage`); non-stream {"choices": [...], "usage": {...}}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from harness.sse import ServerSentEvent

from loadgen.config import Api, LoadConfig
from loadgen.workload import RequestSpec


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    tokens: int
    token_ids: tuple[int, ...] = ()  # where the API sends them (native), else empty


@dataclass(frozen=True, slots=True)
class Completion:
    finish_reason: str | None
    prompt_tokens: int | None
    output_tokens: int | None  # None: the server sent no usage


@dataclass(frozen=True, slots=True)
class Failure:
    error: str  # e.g. "stream internal"


StreamItem = TextDelta | Completion | Failure


class StreamDecoder(Protocol):
    def decode(self, event: ServerSentEvent) -> list[StreamItem]: ...


class ApiFormat(Protocol):
    """Request body and answer decoding for one API; `path` is appended to --url."""

    path: str

    def body(self, spec: RequestSpec) -> dict[str, Any]: ...

    def stream_decoder(self) -> StreamDecoder: ...

    def decode_response(self, payload: Any) -> tuple[TextDelta, Completion]: ...


def api_format(config: LoadConfig) -> ApiFormat:
    if config.api is Api.OPENAI:
        return OpenAIFormat(config)
    return NativeFormat()


class NativeFormat:
    path = "/generate"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        return {
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "ignore_eos": spec.ignore_eos,
            "stream": spec.stream,
        }

    def stream_decoder(self) -> StreamDecoder:
        return NativeStreamDecoder()

    def decode_response(self, payload: Any) -> tuple[TextDelta, Completion]:
        completion = native_completion(payload)
        token_ids = tuple(payload.get("token_ids") or ())
        tokens = completion.output_tokens or len(token_ids)
        return TextDelta(payload.get("text") or "", tokens, token_ids), completion


class NativeStreamDecoder:
    def decode(self, event: ServerSentEvent) -> list[StreamItem]:
        payload = json.loads(event.data)
        if event.event == "token":
            token_ids = payload.get("token_ids")
            if not isinstance(token_ids, list):
                return [TextDelta(payload.get("text") or "", 1)]
            return [TextDelta(payload.get("text") or "", len(token_ids), tuple(token_ids))]
        if event.event == "done":
            return [native_completion(payload)]
        if event.event == "error":
            return [Failure(f"stream {error_type(payload)}")]
        return []


def native_completion(payload: dict[str, Any]) -> Completion:
    usage = payload.get("usage") or {}
    return Completion(
        finish_reason=payload.get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens"),
        output_tokens=usage.get("completion_tokens"),
    )


class OpenAIFormat:
    path = "/v1/completions"

    def __init__(self, config: LoadConfig) -> None:
        self._model = config.model

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "stream": spec.stream,
        }
        if self._model is not None:
            body["model"] = self._model
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        if spec.ignore_eos:
            body["ignore_eos"] = True  # not OpenAI's; servers that serve both APIs accept it
        return body

    def stream_decoder(self) -> StreamDecoder:
        return OpenAIStreamDecoder()

    def decode_response(self, payload: Any) -> tuple[TextDelta, Completion]:
        choice = (payload.get("choices") or [{}])[0]
        usage = payload.get("usage") or {}
        completion = Completion(
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=usage.get("prompt_tokens"),
            output_tokens=usage.get("completion_tokens"),
        )
        return TextDelta(choice.get("text") or "", completion.output_tokens or 0), completion


class OpenAIStreamDecoder:
    """Remembers the finish reason and usage from the chunks; `[DONE]` completes the stream."""

    def __init__(self) -> None:
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] = {}

    def decode(self, event: ServerSentEvent) -> list[StreamItem]:
        if event.data.strip() == "[DONE]":
            return [self._completion()]
        chunk = json.loads(event.data)
        if "error" in chunk:
            return [Failure(f"stream {error_type(chunk)}")]
        self._usage = chunk.get("usage") or self._usage
        items: list[StreamItem] = []
        for choice in chunk.get("choices") or ():
            text = choice.get("text") or ""
            items.append(TextDelta(text, 1 if text else 0))  # OpenAI chunks carry no token ids
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
        return items

    def _completion(self) -> Completion:
        return Completion(
            finish_reason=self._finish_reason,
            prompt_tokens=self._usage.get("prompt_tokens"),
            output_tokens=self._usage.get("completion_tokens"),
        )


def error_type(payload: Any) -> str:
    """The `error.type` of an error body, or "unknown" when the body has none."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and isinstance(error.get("type"), str):
        return error["type"]
    return "unknown"
