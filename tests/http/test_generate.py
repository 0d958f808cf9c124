"""POST /generate and DELETE /generate/{id} in-process (httpx ASGI transport, mock model)."""

from __future__ import annotations

import asyncio

import pytest
from harness.wait import wait_for

from app.models.base import StepBatch, StepOutput
from tests.http.conftest import (
    RecordingMock,
    app_client,
    metric_value,
    mock_config,
    parse_sse,
    wait_for_queue,
)


async def generate(client, **body):
    return await client.post("/generate", json=body)


async def stream(client, headers=None, **body):
    response = await client.post("/generate", json={**body, "stream": True}, headers=headers)
    return response, parse_sse(response.text)


@pytest.mark.parametrize(
    "prompt", ["Hello, world", "日本語で答えてください", "emoji 😀🎉 and more 🚀", "中文 mixed é ß"]
)
async def test_stream_joined_equals_non_stream(client, prompt):
    body = {"prompt": prompt, "max_tokens": 64, "seed": 1}
    plain = await generate(client, **body)
    assert plain.status_code == 200
    data = plain.json()
    response, events = await stream(client, **body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    tokens = [d for name, d in events if name == "token"]
    finals = [(name, d) for name, d in events if name in ("done", "error")]
    assert len(finals) == 1 and events[-1][0] == "done"
    assert "".join(d["text"] for d in tokens) == data["text"]
    assert [t for d in tokens for t in d["token_ids"]] == data["token_ids"]
    assert "\ufffd" not in data["text"]
    assert all("\ufffd" not in d["text"] for d in tokens)
    done = finals[0][1]
    assert done["finish_reason"] == data["finish_reason"]
    assert done["usage"] == data["usage"]
    assert set(done["timings"]) == {"queued_ms", "ttft_ms", "total_ms"}


async def test_response_shape_and_request_id(client):
    response = await client.post(
        "/generate", json={"prompt": "abc", "max_tokens": 5}, headers={"X-Request-Id": "my.id-1"}
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "my.id-1"
    body = response.json()
    assert set(body) == {
        "id",
        "text",
        "token_ids",
        "finish_reason",
        "stop_reason",
        "usage",
        "timings",
    }
    assert body["id"] == "my.id-1"
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == len(body["token_ids"]) <= 5
    server_made = await generate(client, prompt="abc", max_tokens=1)
    assert len(server_made.headers["x-request-id"]) >= 32
    assert server_made.json()["id"] == server_made.headers["x-request-id"]


async def test_form_content_type_is_read_as_json(client):
    response = await client.post(
        "/generate",
        content=b'{"prompt": "The capital", "max_tokens": 3}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 200


async def test_stop_string_spanning_tokens_never_streamed(client):
    body = {"prompt": "stop test 12", "max_tokens": 80, "ignore_eos": True}
    text = (await generate(client, **body)).json()["text"]
    assert len(text) > 10
    stop = text[5:9]  # several byte tokens
    expected = text[: text.index(stop)]
    response, events = await stream(client, **body, stop=[stop])
    streamed = "".join(d["text"] for name, d in events if name == "token")
    assert streamed == expected
    done = events[-1][1]
    assert done["finish_reason"] == "stop" and done["stop_reason"] == stop
    plain = (await generate(client, **body, stop=[stop])).json()
    assert plain["text"] == expected and plain["stop_reason"] == stop


async def test_max_tokens_zero(client):
    body = (await generate(client, prompt="x", max_tokens=0)).json()
    assert body["text"] == "" and body["finish_reason"] == "length" and body["token_ids"] == []
    assert body["timings"]["ttft_ms"] is None
    assert client.model.started_prompts == []  # never took a slot


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "a", "stop": [""]}, "stop.0"),
        ({"prompt": "a", "stop": ["x"] * 9}, "stop"),
        ({"prompt": "a", "stop": ["x" * 257]}, "stop.0"),
        ({"prompt": "a", "temperature": -0.5}, "temperature"),
        ({"prompt": "a", "temperature": 2.5}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "top_k": -1}, "top_k"),
        ({"prompt": "a", "seed": -1}, "seed"),
        ({"prompt": "a", "seed": 2**63}, "seed"),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "ignore_eos": 1}, "ignore_eos"),
        ({"prompt": "a", "stop_token_ids": [257]}, "stop_token_ids"),
        ({"prompt": "a", "stop_token_ids": [-3]}, "stop_token_ids.0"),
        ({"prompt": "a", "unknown": 1}, "unknown"),
        ({"prompt": "a", "max_tokens": 9000}, "max_tokens"),
    ],
)
async def test_validation_errors_are_422_with_the_error_shape(client, body, param):
    response = await client.post("/generate", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert set(error) == {"type", "message", "param"}
    assert error["type"] == "invalid_request"
    assert error["param"] == param
    assert "Traceback" not in response.text
    assert response.headers["x-request-id"]
    assert (await generate(client, prompt="still serving", max_tokens=2)).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "a", "temperature": NaN}',
        b'{"prompt": "a", "temperature": Infinity}',
        b"{not json",
        b"",
        b"[1, 2]",
        b'"just a string"',
    ],
)
async def test_bad_json_is_422(client, raw):
    response = await client.post(
        "/generate", content=raw, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["type"] == "invalid_request"


async def test_context_length_exceeded_is_400():
    async with app_client(mock_config(mock_context_length=64)) as client:
        response = await generate(client, prompt="x" * 60, max_tokens=10)
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "context_length_exceeded"
        ok = await generate(client, prompt="x" * 54, max_tokens=10)
        assert ok.status_code == 200


async def test_invalid_client_request_id_is_422(client):
    response = await client.post(
        "/generate", json={"prompt": "a"}, headers={"X-Request-Id": "bad id!"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "X-Request-Id"
    assert response.headers["x-request-id"] != "bad id!"


async def test_unknown_path_is_404_with_shape_and_id(client):
    response = await client.get("/nope")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found"
    assert response.headers["x-request-id"]


async def test_duplicate_in_flight_id_is_409_and_reuse_after_finish_works():
    async with app_client(mock_config(mock_step_ms=20)) as client:
        headers = {"X-Request-Id": "dup-1"}
        first = asyncio.create_task(
            client.post(
                "/generate",
                json={"prompt": "a", "max_tokens": 20, "ignore_eos": True},
                headers=headers,
            )
        )
        await wait_for_queue(client, running=1)
        second = await client.post("/generate", json={"prompt": "b"}, headers=headers)
        assert second.status_code == 409
        assert second.json()["error"]["type"] == "conflict"
        assert second.headers["x-request-id"] == "dup-1"
        assert (await first).status_code == 200
        again = await client.post(
            "/generate", json={"prompt": "b", "max_tokens": 2}, headers=headers
        )
        assert again.status_code == 200


async def test_delete_running_request_then_reuse_id():
    async with app_client(mock_config(mock_step_ms=10)) as client:
        headers = {"X-Request-Id": "job-7"}
        body = {"prompt": "long", "max_tokens": 500, "ignore_eos": True}
        task = asyncio.create_task(client.post("/generate", json=body, headers=headers))

        async def generating() -> bool:
            return await metric_value(client, "slotserve_generated_tokens_total") > 0

        await wait_for(generating)
        deleted = await client.delete("/generate/job-7")
        assert deleted.status_code == 200
        assert deleted.json() == {"id": "job-7", "status": "cancelled"}
        assert (await client.delete("/generate/job-7")).status_code == 404  # second DELETE
        reused = await client.post(
            "/generate", json={"prompt": "x", "max_tokens": 3}, headers=headers
        )
        assert reused.status_code == 200
        result = (await task).json()
        assert result["finish_reason"] == "cancelled"
        assert 0 < result["usage"]["completion_tokens"] < 500
        assert len(result["text"].encode()) <= result["usage"]["completion_tokens"]
        assert await metric_value(client, "slotserve_requests_running") == 0


async def test_delete_waiting_request_never_runs():
    async with app_client(mock_config(max_num_seqs=1, mock_step_ms=10)) as client:
        blocker = asyncio.create_task(
            client.post(
                "/generate", json={"prompt": "blocker", "max_tokens": 30, "ignore_eos": True}
            )
        )
        await wait_for_queue(client, running=1)
        queued = asyncio.create_task(
            client.post("/generate", json={"prompt": "queued"}, headers={"X-Request-Id": "q1"})
        )
        await wait_for_queue(client, running=1, waiting=1)
        assert (await client.delete("/generate/q1")).status_code == 200
        result = (await queued).json()
        assert result["finish_reason"] == "cancelled" and result["token_ids"] == []
        await blocker
        assert b"queued" not in client.model.started_prompts


async def test_delete_unknown_and_finished_are_404(client):
    assert (await client.delete("/generate/nobody")).status_code == 404
    await client.post(
        "/generate", json={"prompt": "a", "max_tokens": 2}, headers={"X-Request-Id": "done1"}
    )
    response = await client.delete("/generate/done1")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found"


async def test_health_info_metrics(client):
    assert (await client.get("/health")).json() == {"status": "ok"}
    info = (await client.get("/info")).json()
    assert info["model"] == "mock-bytes" and info["max_num_seqs"] == 4
    assert {"backend", "context_length", "version"} <= set(info)
    await generate(client, prompt="count me", max_tokens=4)
    text = (await client.get("/metrics")).text
    for name in [
        "slotserve_requests_waiting",
        "slotserve_requests_running",
        "slotserve_requests_finished_total",
        "slotserve_prompt_tokens_total",
        "slotserve_generated_tokens_total",
        "slotserve_time_to_first_token_seconds_bucket",
        "slotserve_inter_token_latency_seconds_bucket",
        "slotserve_request_latency_seconds_bucket",
        "slotserve_batch_size_bucket",
    ]:
        assert name in text, name
    assert await metric_value(client, "slotserve_prompt_tokens_total") == len("count me")


class FailingMock(RecordingMock):
    """Fails every step that carries a prompt containing 'FAIL'."""

    def step(self, batch: StepBatch) -> StepOutput:
        for row in batch.rows:
            if b"FAIL" in bytes(t for t in row.token_ids if t < 256):
                raise RuntimeError("injected model failure")
        return super().step(batch)


async def test_model_failure_fails_only_that_step_and_server_goes_on():
    config = mock_config()
    async with app_client(config, model=FailingMock(max_num_seqs=4)) as client:
        bad = await generate(client, prompt="please FAIL", max_tokens=5)
        assert bad.status_code == 500
        assert bad.json()["error"]["type"] == "internal"
        assert "Traceback" not in bad.text and "injected" not in bad.text
        response, events = await stream(client, prompt="stream FAIL", max_tokens=5)
        assert response.status_code == 200 and events[-1][0] == "error"
        assert [name for name, _ in events].count("error") == 1
        good = await generate(client, prompt="fine", max_tokens=5)
        assert good.status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_the_mock_scores_every_prompt_token(client):
    """``--model mock`` answers ``prompt_logprobs`` and ``echo`` + ``logprobs`` as API.md says:
    one entry a prompt token, the first null (found by a helper: the mock gave ``[]``). Its
    model is certain: the token it would have produced scores 0 (after "abc" it produces
    "k"), any other token -9999.0 (finite: JSON has no -inf)."""
    body = {"prompt": "abck", "max_tokens": 2, "prompt_logprobs": 1}
    for _ in range(2):  # the same slot again: its next request is a prompt again
        answer = (await client.post("/generate", json=body)).json()
        entries = answer["prompt_logprobs"]
        assert entries[0] is None and [e["token_id"] for e in entries[1:]] == [98, 99, 107]
        assert [e["logprob"] for e in entries[1:]] == [-9999.0, -9999.0, 0.0]
        assert all(len(e["top"]) == 1 and e["top"][0]["logprob"] == 0.0 for e in entries[1:])
        assert entries[3]["top"][0]["token_id"] == 107
    echo = {"model": "m", "prompt": "abck", "max_tokens": 0, "echo": True, "logprobs": 1}
    logprobs = (await client.post("/v1/completions", json=echo)).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c", "k"]
    assert logprobs["token_logprobs"] == [None, -9999.0, -9999.0, 0.0]
