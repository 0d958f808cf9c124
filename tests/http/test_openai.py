"""The OpenAI-compatible API (/v1) on the mock model: in-process for the wire format and the
errors, and the real ``openai`` SDK against a live uvicorn for what clients see."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from harness.sse import EventStream
from harness.wait import wait_for

from app.api.openai.wire_fields import TOLERATED_FIELDS
from app.engine.chat_template import ChatMessage, ChatTemplate
from app.models.mock import ByteTokenizer
from tests.http.conftest import app_client, metric_value, mock_config, wait_for_queue

MODEL = "mock-bytes"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
LONG = {"max_tokens": 2000, "extra_body": {"ignore_eos": True}}  # the mock stops at random


def chatml(messages: list[dict[str, str]]) -> str:
    turns = [ChatMessage(m["role"], m["content"]) for m in messages]
    return ChatTemplate.of(ByteTokenizer()).render(turns)


def sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of an OpenAI-style stream; asserts its framing on the way."""
    assert "\r" not in text and text.endswith("\n\n")
    blocks = [block for block in text.split("\n\n") if block and not block.startswith(":")]
    assert all(block.startswith("data: ") and "\n" not in block for block in blocks), blocks
    return [block.removeprefix("data: ") for block in blocks]


def sdk(url: str, api_key: str = "none", **options) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=10, **options
    )


# --------------------------------------------------------------------------- in-process


async def test_same_answers_as_generate_and_ids_are_request_ids(client):
    native = (await client.post("/generate", json={"prompt": "Hello", "max_tokens": 12})).json()
    response = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": ["Hello"], "max_tokens": 12},
        headers={"X-Request-Id": "oa.id-1"},
    )
    assert response.status_code == 200
    body = response.json()
    assert body["id"] == "oa.id-1" == response.headers["x-request-id"]
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["system_fingerprint"] is None and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["text"] == native["text"] and choice["finish_reason"] == native["finish_reason"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": native["usage"]["completion_tokens"],
        "total_tokens": 5 + native["usage"]["completion_tokens"],
    }

    prompt = chatml(CHAT)
    native = (await client.post("/generate", json={"prompt": prompt, "max_tokens": 40})).json()
    response = await client.post(
        "/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 40}
    )
    body = response.json()
    assert body["id"] == response.headers["x-request-id"]  # server-made
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": native["text"]}
    assert body["usage"]["prompt_tokens"] == len(prompt.encode())


async def test_chat_stream_wire_format(client):
    body = {"messages": CHAT, "max_tokens": 40, "seed": 3}
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    response = await client.post(
        "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_data(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {c["id"] for c in chunks} == {response.headers["x-request-id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    first, *middle, final, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"][0]["finish_reason"] is None for c in [first, *middle])
    assert all(c["usage"] is None for c in [first, *middle, final])
    joined = "".join(c["choices"][0]["delta"]["content"] for c in middle)
    assert joined == whole["choices"][0]["message"]["content"]
    assert final["choices"][0]["delta"] == {}
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


async def test_completion_stream_without_usage(client):
    body = {"prompt": "stream me", "max_tokens": 30, "stop": "e"}
    whole = (await client.post("/v1/completions", json=body)).json()
    response = await client.post("/v1/completions", json={**body, "stream": True})
    payloads = sse_data(response.text)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]" and chunks[-1]["choices"][0]["text"] == ""
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert "e" not in whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/completions", {"prompt": "a", "temperature": 5}, "temperature", "invalid_value"),
        ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p", "invalid_value"),
        ("/v1/completions", {"prompt": "a", "max_tokens": -1}, "max_tokens", "invalid_value"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 9000}, "max_tokens", "invalid_value"),
        ("/v1/completions", {"prompt": "a", "seed": -1}, "seed", "invalid_value"),
        ("/v1/completions", {"prompt": "a", "stop": ["x"] * 9}, "stop", "invalid_value"),
        ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream", "invalid_value"),
        ("/v1/completions", {"prompt": ""}, "prompt", "invalid_value"),
        ("/v1/completions", {}, "prompt", "missing_required_parameter"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "unsupported_value"),
        # issue 15 made token-id prompts, n, best_of == n, logprobs, echo, the penalties and
        # logit_bias supported: what is refused now is their values out of range
        ("/v1/completions", {"prompt": [[1], [2]]}, "prompt", "unsupported_value"),
        ("/v1/completions", {"prompt": "a", "n": 17}, "n", "invalid_value"),
        ("/v1/completions", {"prompt": "a", "best_of": 3}, "best_of", "unsupported_value"),
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs", "invalid_value"),
        (
            "/v1/completions",
            {"prompt": "a", "echo": True, "logprobs": 1, "stream": True},
            "echo",
            "unsupported_value",
        ),
        ("/v1/completions", {"prompt": "a", "suffix": "z"}, "suffix", "unsupported_value"),
        (
            "/v1/completions",
            {"prompt": "a", "presence_penalty": 2.5},
            "presence_penalty",
            "invalid_value",
        ),
        (
            "/v1/completions",
            {"prompt": "a", "frequency_penalty": -2.5},
            "frequency_penalty",
            "invalid_value",
        ),
        (
            "/v1/completions",
            {"prompt": "a", "logit_bias": {"5": 101}},
            "logit_bias.5",
            "invalid_value",
        ),
        (
            "/v1/completions",
            {"prompt": "a", "stream_options": {"include_usage": True}},
            "stream_options",
            "invalid_value",
        ),
        ("/v1/chat/completions", {"messages": []}, "messages", "invalid_value"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages.0",
            "missing_required_parameter",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
            "unsupported_value",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_completion_tokens": 9000},
            "max_completion_tokens",
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "tools": [{"type": "function"}]},
            "tools.0.function",
            "missing_required_parameter",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "xml"}},
            "response_format.type",
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"dependentSchemas": {}}},
                },
            },
            "response_format",
            "invalid_value",
        ),
    ],
)
async def test_bad_fields_are_400_naming_the_field(client, path, body, param, code):
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json() == {
        "error": {
            "message": response.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }
    assert param.split(".")[0] in response.json()["error"]["message"]
    assert response.headers["x-request-id"]


async def test_a_validators_refusal_reads_as_it_was_written(client):
    """A validator's ValueError reaches the body as its own text, without pydantic's
    "Value error, " before it (the failing input: /tokenize with both a prompt and messages)."""
    body = {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}
    response = await client.post("/tokenize", json=body)
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert message == "send exactly one of 'prompt' and 'messages'"


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", {"prompt": [-5]}, "prompt.0", "greater than or equal to 0"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "bogus"},
            "tool_choice",
            "'none', 'auto' or 'required'",
        ),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            None,
            "messages.0.content.0: Input tag 'image'",
        ),
    ],
)
async def test_a_field_of_several_types_is_refused_by_its_deepest_complaint(
    client, path, body, param, message
):
    """(found by a helper: ``prompt: [-5]`` was refused as ``prompt.str``: "Input should be a
    valid string", and a bogus ``tool_choice`` named ``tool_choice.literal['none','auto',
    'required']``.) The complaint that went deepest into the value is told, under the
    request's own field names."""
    body = {"model": "m", "max_tokens": 2, **body}
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param
    assert "[" not in error["message"].split(":")[0]


async def test_accepted_fields_and_unknown_ones(client):
    body = {
        "model": "anything",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}], "name": "ann"},
        ],
        "max_tokens": 5,
        "max_completion_tokens": 3,  # wins over max_tokens
        "user": "user-1",
        "metadata": {"team": "eval"},  # OpenAI's bookkeeping fields: accepted, change nothing
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "store": False,
        "n": 1,
        "presence_penalty": 0,
        "logprobs": False,
        "response_format": {"type": "text"},
        "parallel_tool_calls": False,
        "ignore_eos": True,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model"] == MODEL
    assert answer["usage"]["completion_tokens"] == 3
    assert answer["choices"][0]["finish_reason"] == "length"
    rendered = chatml(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    )
    assert answer["usage"]["prompt_tokens"] == len(rendered.encode())


# Fields a vLLM or OpenAI client may send that this server does not honour: each was answered
# 200 and ignored (stop_token_ids did not stop, guided_choice did not constrain).
UNKNOWN_FIELDS = [
    ("include_stop_str_in_output", True),
    ("skip_special_tokens", False),
    ("guided_choice", ["a", "b"]),
    ("guided_json", {"type": "object"}),
    ("use_beam_search", True),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("reasoning_effort", "low"),
    ("some_future_field", {"x": 1}),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_an_unknown_stream_option_is_a_400_naming_it(client, path):
    """vLLM's ``stream_options.continuous_usage_stats`` (usage in every chunk) is not done
    here: a 400 naming it, not a stream without it (found by a helper trying the SDK's
    options; the options took any key)."""
    body = {"prompt": "abc"} if path == "/v1/completions" else {"messages": CHAT}
    options = {"include_usage": True, "continuous_usage_stats": True}
    response = await client.post(path, json={**body, "stream": True, "stream_options": options})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stream_options.continuous_usage_stats"
    assert "continuous_usage_stats" in error["message"]


@pytest.mark.parametrize(("field", "value"), UNKNOWN_FIELDS, ids=[f for f, _ in UNKNOWN_FIELDS])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "abc", "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
    ],
    ids=["completions", "chat", "responses"],
)
async def test_an_unknown_field_is_a_400_naming_it(client, path, body, field, value):
    response = await client.post(path, json={**body, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    tolerated = field in TOLERATED_FIELDS and path != "/v1/responses"
    assert error["code"] == ("unsupported_value" if tolerated else "unknown_parameter")
    assert error["type"] == "invalid_request_error"
    assert field in error["message"]


@pytest.mark.parametrize("prompt", ["", [""], [], [[]]])
async def test_an_empty_completion_prompt_is_named_as_empty(client, prompt):
    """Found by a new-user test: ``"prompt": ""`` said "Value should have at least 1 item
    after validation, not 0" (pydantic's union of a string and a list)."""
    response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"] == (
        "prompt: the prompt is empty: give at least one character or token id"
    )


async def test_what_vllm_router_adds_to_every_request_is_tolerated(client):
    """The fields vllm-router 0.1.17 was seen to add to each request it forwards, at its values
    (each a 400 when unknown fields were first refused: the routing scenario's every request),
    and null for any field."""
    completion = {"prompt": "abc", "max_tokens": 4, "echo": False, "no_stop_trim": False}
    completion |= {"skip_special_tokens": True, "return_hidden_states": False, "guided_json": None}
    response = await client.post("/v1/completions", json=completion)
    assert response.status_code == 200, response.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": False}
    chat |= {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False}
    chat |= {"skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True}
    chat |= {"return_hidden_states": False, "include_reasoning": True}
    response = await client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text


async def test_stop_token_ids_stop_on_v1_as_on_generate(client):
    """vLLM's ``stop_token_ids`` extension (was accepted and ignored: the text ran on)."""
    plain = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
    text = plain.json()["choices"][0]["text"]
    first = (await client.post("/tokenize", json={"prompt": text[0]})).json()["tokens"][-1]
    body = {"prompt": "abc", "max_tokens": 4, "stop_token_ids": [first]}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert len(choice["text"]) < len(text)


async def test_store_true_is_refused_and_responses_takes_the_bookkeeping_fields(client):
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "store": True},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "store"
    response = await client.post(
        "/v1/responses",
        json={
            "input": "hi",
            "max_output_tokens": 2,
            "metadata": {"a": "b"},
            "user": "u",
            "service_tier": "auto",
            "prompt_cache_key": "k",
            "safety_identifier": "s",
        },
    )
    assert response.status_code == 200, response.text


async def test_context_length_and_chat_default_budget():
    async with app_client(mock_config(mock_context_length=64)) as client:
        short = [{"role": "user", "content": "Hi"}]  # 52 bytes of ChatML
        response = await client.post(
            "/v1/chat/completions", json={"messages": short, "ignore_eos": True}
        )
        body = response.json()
        assert body["usage"] == {"prompt_tokens": 52, "completion_tokens": 12, "total_tokens": 64}
        assert body["choices"][0]["finish_reason"] == "length"

        too_long = await client.post("/v1/completions", json={"prompt": "x" * 60, "max_tokens": 10})
        assert too_long.status_code == 400
        error = too_long.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        full = [{"role": "user", "content": "x" * 14}]  # 64 tokens: no room left
        no_room = await client.post("/v1/chat/completions", json={"messages": full})
        assert no_room.status_code == 400
        assert no_room.json()["error"]["code"] == "context_length_exceeded"
        assert no_room.json()["error"]["param"] == "messages"


async def test_error_shapes_under_v1_and_elsewhere(client):
    unknown = await client.get("/v1/nope")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "invalid_request_error"
    assert unknown.json()["error"]["code"] == "not_found"
    assert (await client.get("/v1/models/nope")).json()["error"]["param"] == "model"
    wrong_method = await client.get("/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"]
    assert (await client.get("/nope")).json() == {
        "error": {"type": "not_found", "message": "not found", "param": None}
    }
    native = await client.post("/generate", json={"prompt": "a", "temperature": 5})
    assert native.status_code == 422 and set(native.json()["error"]) == {"type", "message", "param"}
    bad_json = await client.post("/v1/completions", content=b"{nope")
    assert bad_json.status_code == 400 and bad_json.json()["error"]["param"] is None


async def test_conflict_and_auth_use_the_openai_shape():
    async with app_client(mock_config(api_key="k1", mock_step_ms=10)) as client:
        unauthorized = await client.get("/v1/models")
        assert unauthorized.status_code == 401
        assert unauthorized.json()["error"]["type"] == "authentication_error"
        assert unauthorized.json()["error"]["code"] == "unauthorized"
        headers = {"Authorization": "Bearer k1", "X-Request-Id": "dup"}
        body = {"prompt": "a", "max_tokens": 50, "ignore_eos": True}
        first = asyncio.create_task(client.post("/v1/completions", json=body, headers=headers))
        await wait_for_queue(client, running=1, headers={"Authorization": "Bearer k1"})
        second = await client.post("/v1/completions", json=body, headers=headers)
        assert second.status_code == 409
        assert second.json()["error"]["code"] == "conflict"
        assert second.json()["error"]["param"] == "X-Request-Id"
        assert (await first).status_code == 200


async def test_model_failure_is_500_or_an_error_chunk(client):
    body = {"prompt": "boom <<fail>>", "max_tokens": 5}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "Traceback" not in response.text
    streamed = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "boom <<fail>>"}], "stream": True},
    )
    payloads = sse_data(streamed.text)
    assert payloads[-1] == "[DONE]"
    role, error = (json.loads(p) for p in payloads[:-1])
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert error["error"]["type"] == "server_error" and error["error"]["message"]


async def test_unexpected_failure_is_an_openai_shaped_500(client, monkeypatch):
    def broken(self, messages):
        raise RuntimeError("template bug")

    monkeypatch.setattr(ChatTemplate, "render", broken)
    response = await client.post("/v1/chat/completions", json={"messages": CHAT})
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "internal server error",
        "type": "server_error",
        "param": None,
        "code": "internal",
    }
    assert "template bug" not in response.text and response.headers["x-request-id"]


# --------------------------------------------------------------------------- the openai SDK


@pytest.mark.slow
async def test_sdk_models_completions_and_chat(live_server_factory):
    server = live_server_factory()
    client = sdk(server.url)
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["chat_template"] == "chatml-fallback"
    assert (await client.models.retrieve(MODEL)).id == MODEL

    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt="Say hello", max_tokens=20, temperature=0, stop=["zz"], user="u1"
    )
    completion = raw.parse()
    assert completion.id == raw.headers["x-request-id"]
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens == len(b"Say hello")
    assert completion.usage.total_tokens == 9 + completion.usage.completion_tokens

    chat = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=30, seed=7
    )
    message = chat.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert chat.usage.prompt_tokens == len(chatml(CHAT).encode())
    assert chat.system_fingerprint is None and chat.model == MODEL


@pytest.mark.slow
async def test_sdk_streams_with_and_without_usage(live_server_factory):
    server = live_server_factory()
    client = sdk(server.url)
    whole = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40)
    chunks = [
        chunk
        async for chunk in await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage

    stream = await client.completions.create(model=MODEL, prompt="abc", max_tokens=25, stream=True)
    pieces = [chunk async for chunk in stream]
    assert all(chunk.usage is None for chunk in pieces)
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    whole_text = await client.completions.create(model=MODEL, prompt="abc", max_tokens=25)
    assert "".join(p.choices[0].text for p in pieces) == whole_text.choices[0].text


@pytest.mark.slow
async def test_sdk_raises_its_own_exceptions(live_server_factory):
    server = live_server_factory()
    client = sdk(server.url)
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model=MODEL, prompt="a", temperature=5)
    assert bad.value.status_code == 400
    assert bad.value.code == "invalid_value" and bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError, match="best_of must equal n"):  # n is supported
        await client.completions.create(model=MODEL, prompt="a", n=2, best_of=3)
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4o")
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "<<fail>>"}], stream=True
    )
    with pytest.raises(openai.APIError, match="injected failure"):
        async for _ in stream:
            pass

    keyed = live_server_factory(api_key="secret")
    with pytest.raises(openai.AuthenticationError):
        await sdk(keyed.url, api_key="wrong").models.list()
    assert (await sdk(keyed.url, api_key="secret").models.list()).data[0].id == MODEL


@pytest.mark.slow
async def test_sdk_stream_cancelled_by_delete(live_server_factory):
    server = live_server_factory(mock_step_ms=10)
    client = sdk(server.url, default_headers={"X-Request-Id": "chat-7"})
    stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **LONG)
    chunks = []
    async with httpx.AsyncClient(base_url=server.url) as plain:
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                deleted = await plain.delete(f"/generate/{chunk.id}")
                assert deleted.json() == {"id": "chat-7", "status": "cancelled"}
    assert chunks[-1].choices[0].finish_reason == "cancelled"
    assert chunks[-1].choices[0].delta.content is None
    assert len(chunks) < 100


@pytest.mark.slow
async def test_delete_of_an_n_answer_cancels_every_choice(live_server_factory):
    """The answer's id is choice 0's; its DELETE used to cancel choice 0 only."""
    server = live_server_factory(mock_step_ms=5, max_num_seqs=4)
    body = {"model": MODEL, "prompt": "go", "n": 3, "stream": True, "max_tokens": 2000}
    body["ignore_eos"] = True  # the mock stops at random
    finished: dict[int, str] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers={"X-Request-Id": "many"}
        ) as response:
            assert response.status_code == 200
            await wait_for_queue(client, running=3)
            deleted = await client.delete("/generate/many")
            assert deleted.status_code == 200
            async for event in EventStream(response):
                if event.data.startswith("{"):
                    for choice in event.json()["choices"]:
                        if choice["finish_reason"] is not None:
                            finished[choice["index"]] = choice["finish_reason"]
        assert finished == {0: "cancelled", 1: "cancelled", 2: "cancelled"}
        await wait_for_queue(client, running=0)


@pytest.mark.slow
async def test_sdk_client_leaving_cancels(live_server_factory):
    server = live_server_factory(mock_step_ms=20, max_num_seqs=2)
    client = sdk(server.url)
    stream = await client.completions.create(model=MODEL, prompt="go", stream=True, **LONG)
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.close()  # the connection is gone, mid-stream
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(model=MODEL, messages=CHAT, timeout=0.3, **LONG)

    async with httpx.AsyncClient(base_url=server.url) as plain:

        async def both_cancelled() -> bool:
            running = await metric_value(plain, "slotserve_requests_running")
            cancelled = await metric_value(
                plain, "slotserve_requests_finished_total", finish_reason="cancelled"
            )
            return running == 0 and cancelled == 2

        await wait_for(both_cancelled, timeout=3)
        assert await metric_value(plain, "slotserve_generated_tokens_total") < 200


async def test_responses_take_the_v1_extensions(client):
    """API.md's /v1 extensions (``extra_body``) on /v1/responses too (they were 400s there,
    where chat takes them; found by a helper)."""
    body = {"input": "hi", "max_output_tokens": 6, "ignore_eos": True, "min_tokens": 6}
    body |= {"min_p": 0.1, "repetition_penalty": 1.1, "top_k": 5, "seed": 3}
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] == 6
    choice = {"type": "choice", "choices": ["alpha", "beta"]}
    response = await client.post("/v1/responses", json={"input": "hi", "constraint": choice})
    assert response.status_code == 200, response.text
    assert response.json()["output"][-1]["content"][0]["text"] in ("alpha", "beta")
    both = {"input": "hi", "constraint": choice, "text": {"format": {"type": "json_object"}}}
    response = await client.post("/v1/responses", json=both)
    assert response.status_code == 400, response.text


async def test_a_chat_rendered_as_chatml_stops_at_its_end_of_turn(client):
    """(found by a helper: Gemma 3's base file, chats rendered by the ChatML fallback, wrote
    ``<|im_end|>`` as text and went on with another turn to ``max_tokens``.) Where the fallback
    renders chats, its end of turn is a stop string of every chat; a plain completion is not
    a chat and keeps it."""
    forced = {"type": "regex", "pattern": r"Hi<\|im_end\|>\n<\|im_start\|>user"}
    chat = await client.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 40,
            "constraint": forced,
        },
    )
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Hi", "stop")
    plain = await client.post(
        "/v1/completions",
        json={"model": "m", "prompt": "hello", "max_tokens": 40, "constraint": forced},
    )
    assert plain.json()["choices"][0]["text"] == "Hi<|im_end|>\n<|im_start|>user"
