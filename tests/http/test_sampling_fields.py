"""The sampling fields at the edge (mock model): each one validated in API.md's error shapes,
accepted where valid, listed by /info; /tokenize and /detokenize in vLLM's shapes."""

from __future__ import annotations

import pytest

from app.api.schemas import SAMPLING_FIELDS, GenerateRequestBody

BAD_NATIVE = [
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.1}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"logit_bias": {"x1": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"999999": 1.0}}, "logit_bias"),  # outside the mock's 512-token vocabulary
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_NATIVE)
async def test_bad_sampling_fields_are_422_naming_the_field(client, extra, param) -> None:
    response = await client.post("/generate", json={"prompt": "hi", "max_tokens": 8, **extra})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request"
    assert error["param"] == param


async def test_valid_sampling_fields_are_accepted(client) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 4,
        "min_p": 0.1,
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "repetition_penalty": 1.2,
        "min_tokens": 4,
        "logit_bias": {"5": -100, "7": 100},
        "logprobs": 0,
    }
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["logprobs"]
    assert len(logprobs) == len(response.json()["token_ids"])
    assert all(entry["top"] == [] for entry in logprobs)
    plain = (await client.post("/generate", json={"prompt": "hi", "max_tokens": 2})).json()
    assert "logprobs" not in plain


BAD_OPENAI = [
    ("/v1/completions", {"n": 17}, "n"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"min_p": 2}, "min_p"),
    ("/v1/completions", {"repetition_penalty": -1}, "repetition_penalty"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"n": 5}, "n"),  # more choices than the mock's 4 slots
]


@pytest.mark.parametrize(("path", "extra", "param"), BAD_OPENAI)
async def test_bad_openai_fields_are_400_naming_the_field(client, path, extra, param) -> None:
    base = (
        {"prompt": "hi", "max_tokens": 2}
        if path.endswith("/completions") and "chat" not in path
        else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    response = await client.post(path, json={"model": "m", **base, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_openai_accepts_penalties_bias_and_extensions(client) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "logit_bias": {"10": 5},
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 1,
        "n": 2,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]


async def test_info_lists_the_sampling_fields(client) -> None:
    info = (await client.get("/info")).json()
    assert info["sampling_fields"] == list(SAMPLING_FIELDS)
    assert set(SAMPLING_FIELDS) <= set(GenerateRequestBody.model_fields)


async def test_tokenize_and_detokenize_round_trip(client) -> None:
    tokenized = (await client.post("/tokenize", json={"prompt": "héllo"})).json()
    assert tokenized["tokens"] == list("héllo".encode())  # the mock is byte-level
    assert tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == (await client.get("/info")).json()["context_length"]
    text = (await client.post("/detokenize", json={"tokens": tokenized["tokens"]})).json()
    assert text == {"prompt": "héllo"}


async def test_tokenize_messages_through_the_chat_template(client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    opened = (await client.post("/tokenize", json={"messages": messages})).json()
    closed = (
        await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    ).json()
    chat = (
        await client.post(
            "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 1}
        )
    ).json()
    assert opened["count"] == chat["usage"]["prompt_tokens"]
    assert closed["count"] < opened["count"]
    assert opened["tokens"][: closed["count"]] == closed["tokens"]


async def test_tokenize_continues_the_final_message_as_vllm_does(client) -> None:
    """vllm-router's body for a chat request (continue_final_message, refused as an unknown
    field before): the rendering stops where the last message's content ends."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]
    body = {"messages": messages, "add_generation_prompt": False}
    closed = (await client.post("/tokenize", json=body)).json()
    body["continue_final_message"] = True
    opened = (await client.post("/tokenize", json=body)).json()
    text = (await client.post("/detokenize", json={"tokens": opened["tokens"]})).json()["prompt"]
    assert text.endswith("Hello th")
    assert closed["tokens"][: opened["count"]] == opened["tokens"]
    assert opened["count"] < closed["count"]
    both = {**body, "add_generation_prompt": True}
    assert (await client.post("/tokenize", json=both)).status_code == 422


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {"prompt": ""}, "prompt"),
        ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
        ("/detokenize", {"tokens": [1, 100000]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
async def test_tokenize_errors_are_generates(client, path, body, param) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request"
    assert error["param"] == param
