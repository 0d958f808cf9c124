"""Anthropic's Messages API (/v1/messages) through the official ``anthropic`` SDK, unmodified,
against a live uvicorn: plain and streamed answers (the event order), count_tokens, stop
sequences, tools (a model's call read back, the round trip, ``any`` / ``tool`` constrained on
the mock), and errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest
from harness.threaded_server import serve_in_thread

from app.api import admission, admission_gate, request_path
from app.api.anthropic.errors import anthropic_error_type
from app.api.errors import APIError
from app.api.server import create_app
from app.engine.chat_template import ChatMessage, ChatTemplate
from app.models.mock import ByteTokenizer
from tests.http.conftest import app_client, mock_config, wait_for_queue
from tests.http.scripted_model import ScriptedModel

MODEL = "mock-bytes"
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"],
        "additionalProperties": False,
    },
}
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in (WEATHER, TIME)}


def sdk(url: str, api_key: str = "none") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=api_key, max_retries=0, timeout=30)


def chatml(system: str, messages: list[dict[str, str]]) -> str:
    turns = [ChatMessage("system", system)] + [
        ChatMessage(m["role"], m["content"]) for m in messages
    ]
    return ChatTemplate.of(ByteTokenizer()).render(turns)


# A tool-aware ChatML template (Hermes/Qwen style), as tests/constraints/test_tools.py's.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}"
    "{{ tool['function'] | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls', []) %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL_SCRIPT = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "celsius"}}</tool_call>'
)


def scripted_server(script: str, chat_template: str | None = None, **overrides):
    model = ScriptedModel(script, chat_template, max_num_seqs=2, step_s=overrides.pop("step_s", 0))
    app = create_app(mock_config(max_num_seqs=2, **overrides), model=model)
    return model, serve_in_thread(app)


# --------------------------------------------------------------------------- plain answers


@pytest.mark.slow
async def test_plain_and_streamed_answers_with_the_event_order(live_server_factory):
    server = live_server_factory()
    client = sdk(server.url)
    request = {"model": MODEL, "max_tokens": 60, "system": "Be brief.", "messages": ASK}
    raw = await client.messages.with_raw_response.create(**request)
    message = raw.parse()
    assert message.id == raw.headers["x-request-id"]
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens == len(chatml("Be brief.", ASK).encode())
    text = "".join(block.text for block in message.content)
    assert all(block.type == "text" for block in message.content)
    counted = await client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK)
    assert counted.input_tokens == message.usage.input_tokens

    events = [event async for event in await client.messages.create(**request, stream=True)]
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens == message.usage.input_tokens
    if text:
        assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
        assert set(kinds[2:-3]) == {"content_block_delta"}
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == text
    assert events[-2].delta.stop_reason == message.stop_reason
    assert events[-2].usage.output_tokens == message.usage.output_tokens

    async with client.messages.stream(**request) as stream:
        final = await stream.get_final_message()
    assert [block.text for block in final.content] == [block.text for block in message.content]
    assert final.stop_reason == message.stop_reason


async def test_stop_sequences_and_max_tokens():
    model, running = scripted_server("The answer is 42. Done.")
    with running as server:
        client = sdk(server.url)
        stopped = await client.messages.create(
            model=MODEL, max_tokens=100, messages=ASK, stop_sequences=["42", "zz"]
        )
        assert stopped.content[0].text == "The answer is "
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "42")
        cut = await client.messages.create(model=MODEL, max_tokens=3, messages=ASK)
        assert cut.content[0].text == "The" and cut.stop_reason == "max_tokens"
        assert cut.usage.output_tokens == 3
        whole = await client.messages.create(model=MODEL, max_tokens=100, messages=ASK)
        assert whole.content[0].text == "The answer is 42. Done."
        assert (whole.stop_reason, whole.stop_sequence) == ("end_turn", None)


async def test_a_last_assistant_message_is_continued_as_a_prefill():
    # Anthropic's API continues a final assistant message (a prefill, e.g. "{" to start JSON)
    # instead of closing it and opening another turn; the answer holds what follows.
    model, running = scripted_server(" Paris.")
    prefill = [
        {"role": "user", "content": "Complete: the capital of France is"},
        {"role": "assistant", "content": "The capital of France is "},
    ]
    with running as server:
        client = sdk(server.url)
        message = await client.messages.create(model=MODEL, max_tokens=20, messages=prefill)
        opened = "Complete: the capital of France is<|im_end|>\n<|im_start|>assistant\n"
        assert model.prompts[-1].endswith(opened + "The capital of France is")
        assert message.content[0].text == " Paris." and message.stop_reason == "end_turn"
        counted = await client.messages.count_tokens(model=MODEL, messages=prefill)
        assert counted.input_tokens == message.usage.input_tokens == len(model.prompts[-1])
        streamed = client.messages.stream(model=MODEL, max_tokens=20, messages=prefill)
        async with streamed as stream:
            assert (await stream.get_final_message()).content[0].text == " Paris."
        # a last user message, or an assistant turn of whitespace, is answered in a new turn
        await client.messages.create(model=MODEL, max_tokens=20, messages=prefill[:1])
        assert model.prompts[-1].endswith(opened)
        blank = [*prefill[:1], {"role": "assistant", "content": " "}]
        await client.messages.create(model=MODEL, max_tokens=20, messages=blank)
        assert model.prompts[-1].endswith("<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- tools


async def test_a_models_tool_call_streamed_and_its_result_in_the_next_turn():
    model, running = scripted_server(CALL_SCRIPT, TOOL_TEMPLATE)
    with running as server:
        client = sdk(server.url)
        message = await client.messages.create(
            model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER, TIME]
        )
        assert message.stop_reason == "tool_use"
        text, call = message.content
        assert text.type == "text" and text.text == "Let me check."
        assert call.type == "tool_use" and call.name == "get_weather"
        assert call.input == {"city": "Paris", "unit": "celsius"} and call.id
        assert '"name": "get_weather"' in model.prompts[-1]  # the template rendered the tools

        events = [
            event
            async for event in await client.messages.create(
                model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER, TIME], stream=True
            )
        ]
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts == ["text", "tool_use"]
        pieces = [
            e.delta.partial_json
            for e in events
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        assert json.loads("".join(pieces)) == call.input
        async with client.messages.stream(
            model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER, TIME]
        ) as stream:
            final = await stream.get_final_message()
        assert [block.type for block in final.content] == ["text", "tool_use"]
        assert final.content[1].input == call.input and final.stop_reason == "tool_use"

        follow_up = [
            *ASK,
            {"role": "assistant", "content": [block.model_dump() for block in message.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}],
            },
        ]
        await client.messages.create(model=MODEL, max_tokens=5, messages=follow_up, tools=[WEATHER])
        rendered = model.prompts[-1]
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in rendered
        assert "<|im_start|>tool\n21 C<|im_end|>" in rendered

        none = await client.messages.create(
            model=MODEL,
            max_tokens=200,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "none"},
        )
        assert [block.type for block in none.content] == ["text"]
        assert none.content[0].text == CALL_SCRIPT and none.stop_reason == "end_turn"


@pytest.mark.slow
@pytest.mark.parametrize(
    "tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}], ids=["any", "tool"]
)
async def test_any_and_tool_give_a_valid_tool_use_whatever_the_model(
    live_server_factory, tool_choice
):
    server = live_server_factory()
    client = sdk(server.url)
    request = {
        "model": MODEL,
        "max_tokens": 400,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": {**tool_choice, "disable_parallel_tool_use": True},
    }
    message = await client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    if tool_choice["type"] == "tool":
        assert call.name == "get_time"
    jsonschema.validate(call.input, SCHEMAS[call.name])

    async with client.messages.stream(**request) as stream:
        final = await stream.get_final_message()
    assert [(b.name, b.input) for b in final.content] == [(call.name, call.input)]


# --------------------------------------------------------------------------- errors


@pytest.mark.slow
async def test_errors_in_anthropics_shape(live_server_factory):
    server = live_server_factory()
    client = sdk(server.url)
    with pytest.raises(anthropic.BadRequestError) as missing:
        # messages.create checks for max_tokens itself: the SDK's plain post sends it anyway
        await client.post("/v1/messages", body={"model": MODEL, "messages": ASK}, cast_to=object)
    assert missing.value.status_code == 400
    assert missing.value.body["type"] == "error"
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="not in tools"):
        await client.messages.create(
            model=MODEL,
            max_tokens=5,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "nope"},
        )
    with pytest.raises(anthropic.BadRequestError, match="8192"):
        await client.messages.create(model=MODEL, max_tokens=9000, messages=ASK)
    stream = await client.messages.create(
        model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "<<fail>>"}], stream=True
    )
    with pytest.raises(anthropic.APIStatusError, match="api_error"):
        async for _ in stream:
            pass
    async with httpx.AsyncClient(base_url=server.url) as plain:
        unknown = await plain.post("/v1/messages/nope", json={})
    assert unknown.status_code == 404
    assert unknown.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "unknown path POST /v1/messages/nope"},
    }

    keyed = live_server_factory(api_key="secret")
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await sdk(keyed.url, api_key="wrong").messages.create(
            model=MODEL, max_tokens=5, messages=ASK
        )
    assert refused.value.body["error"]["type"] == "authentication_error"
    answered = await sdk(keyed.url, api_key="secret").messages.create(  # sent as x-api-key
        model=MODEL, max_tokens=5, messages=ASK
    )
    assert answered.usage.output_tokens <= 5


async def test_conversations_anthropic_refuses_are_refused_in_its_words():
    # found by a helper: each of these was answered (200) where Anthropic's API answers 400
    model, running = scripted_server("ok")
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "P"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    refused = {
        "tools: Tool names must be unique.": {"messages": ASK, "tools": [WEATHER, WEATHER]},
        "messages.0: all messages must have non-empty content": {
            "messages": [{"role": "user", "content": ""}]
        },
        "messages.1: all messages must have non-empty content": {
            "messages": [*ASK, {"role": "assistant", "content": []}, *ASK]
        },
        "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_1": {
            "messages": [{"role": "user", "content": [result]}]
        },
    }
    with running as server:
        client = sdk(server.url)
        for message, body in refused.items():
            with pytest.raises(anthropic.BadRequestError) as error:
                await client.messages.create(model=MODEL, max_tokens=5, **body)
            assert error.value.body["error"]["message"].startswith(message), message
        answered = await client.messages.create(
            model=MODEL,
            max_tokens=5,
            tools=[WEATHER],
            messages=[
                *ASK,
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]},
                {"role": "assistant", "content": ""},  # a final assistant turn may be empty
            ],
        )
        assert answered.content[0].text == "ok"


async def test_overload_is_a_rate_limit_error_and_unavailable_is_overloaded():
    config = mock_config(max_num_seqs=1, max_queue=0, mock_step_ms=10)
    async with app_client(config) as client:
        in_process = anthropic.AsyncAnthropic(
            base_url="http://test",
            api_key="none",
            max_retries=0,
            http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=client.app)),
        )
        holding = {"prompt": "holds the slot", "max_tokens": 2000, "ignore_eos": True}
        running = asyncio.create_task(client.post("/generate", json=holding))
        await wait_for_queue(client, running=1)
        try:
            with pytest.raises(anthropic.RateLimitError) as refused:
                await in_process.messages.create(model=MODEL, max_tokens=5, messages=ASK)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        await client.app.state.resources.engine.drain(0)  # not taking requests: /v1 says 503
        with pytest.raises(anthropic.OverloadedError) as draining:
            await in_process.messages.create(model=MODEL, max_tokens=5, messages=ASK)
    assert draining.value.status_code == 529
    assert draining.value.body["error"]["type"] == "overloaded_error"
    assert refused.value.response.headers["retry-after"]
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert anthropic_error_type(APIError(500, "internal", "x")) == ("api_error", 500)


async def test_the_gate_refuses_a_message_as_its_route_would(monkeypatch):
    config = mock_config(max_num_seqs=1, max_queue=0, mock_step_ms=10)
    body = {"model": MODEL, "max_tokens": 5, "messages": ASK}
    headers = {"X-Request-Id": "refused-1", "x-api-key": "k"}
    route_checks: list[str] = []

    def recorded(resources, *, max_tokens=None):
        route_checks.append("/v1/messages")
        admission.refuse_if_overloaded(resources, max_tokens=max_tokens)

    monkeypatch.setattr(request_path, "refuse_if_overloaded", recorded)
    async with app_client(config) as client:
        holding = {"prompt": "holds the slot", "max_tokens": 2000, "ignore_eos": True}
        running = asyncio.create_task(client.post("/generate", json=holding))
        await wait_for_queue(client, running=1)
        route_checks.clear()  # the request holding the slot passed its route's check
        try:
            gated = await client.post("/v1/messages", json=body, headers=headers)
            assert route_checks == []  # answered in front of FastAPI
            monkeypatch.setattr(admission_gate, "WIRE_FORMATS", {})
            routed = await client.post("/v1/messages", json=body, headers=headers)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
    assert route_checks == ["/v1/messages"]  # with the gate off, the route refused it
    assert gated.status_code == 429 and gated.json()["error"]["type"] == "rate_limit_error"
    assert (gated.status_code, dict(gated.headers), gated.content) == (
        routed.status_code,
        dict(routed.headers),
        routed.content,
    )


async def test_a_message_is_cancelled_by_its_id():
    model = ScriptedModel("a" * 3000, max_num_seqs=1, step_s=0.005)
    async with app_client(mock_config(max_num_seqs=1), model=model) as client:
        body = {"model": MODEL, "max_tokens": 4000, "messages": ASK, "stream": True}
        headers = {"X-Request-Id": "msg-7"}

        async def read() -> str:
            response = await client.post("/v1/messages", json=body, headers=headers)
            return response.text

        reading = asyncio.create_task(read())
        await wait_for_queue(client, running=1)
        deleted = await client.delete("/generate/msg-7")
        text = await reading
    assert deleted.json() == {"id": "msg-7", "status": "cancelled"}
    assert '"stop_reason":"cancelled"' in text
    assert text.rstrip().endswith('data: {"type":"message_stop"}')


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/messages", "seed", 3),  # was 200, and the text was not seeded
        ("/v1/messages", "container", "c1"),
        ("/v1/messages", "stop_token_ids", [5]),
        ("/v1/messages/count_tokens", "max_tokens", 5),
    ],
)
async def test_an_unknown_field_is_refused_as_anthropic_refuses_it(client, path, field, value):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5}
    if path.endswith("count_tokens"):
        del body["max_tokens"]
    response = await client.post(path, json={**body, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert field in error["message"]
    accepted = dict(body)
    if not path.endswith("count_tokens"):  # Anthropic's bookkeeping fields of a message
        accepted.update(metadata={"user_id": "u"}, service_tier="auto")
    assert (await client.post(path, json=accepted)).status_code == 200


@pytest.mark.parametrize(
    ("matched", "want"),
    [("\n\nHuman:", ("stop_sequence", "\n\nHuman:")), ("<|im_end|>", ("end_turn", None))],
)
def test_the_fallback_templates_end_of_turn_is_an_end_turn(matched, want):
    """A chat rendered by the ChatML fallback stops at ``<|im_end|>`` (a stop string the
    server adds, not one the client sent): that is ``end_turn``; a client's is a
    ``stop_sequence`` naming it."""
    from app.api.anthropic.answers import _stop_reason
    from app.engine.request import FinalEvent, FinishReason, Timings

    final = FinalEvent(FinishReason.STOP, matched, "Hi", (1, 2), 3, 2, Timings(0.0, 1.0, 2.0))
    assert _stop_reason(final, made_calls=False) == want
