"""Overload, limits, API keys, fault isolation and id races (in-process, mock model)."""

from __future__ import annotations

import asyncio

import pytest
from harness.wait import wait_for
from pydantic import ValidationError

from app.engine.engine import EngineState
from app.models.mock import MockModelRunner
from tests.http.conftest import app_client, metric_value, mock_config, parse_sse, wait_for_queue

LONG = {"max_tokens": 200, "ignore_eos": True}


async def test_full_queue_answers_429_at_once_with_retry_after():
    async with app_client(mock_config(max_num_seqs=1, max_queue=2, mock_step_ms=10)) as client:
        tasks = [
            asyncio.create_task(client.post("/generate", json={"prompt": f"r{i}", **LONG}))
            for i in range(3)  # 1 running + 2 waiting
        ]
        await wait_for_queue(client, running=1, waiting=2)
        rejected = await client.post("/generate", json={"prompt": "one too many"})
        assert rejected.status_code == 429
        assert rejected.headers["retry-after"] == "1"
        assert rejected.json()["error"]["type"] == "overloaded"
        assert (
            await metric_value(client, "slotserve_requests_rejected_total", type="overloaded") == 1
        )
        # cancel the waiting ones so the test ends fast; then the queue has room again
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_queued_prompt_tokens_cap():
    config = mock_config(max_num_seqs=1, max_queued_tokens=20, mock_step_ms=10)
    async with app_client(config) as client:
        running = asyncio.create_task(client.post("/generate", json={"prompt": "x" * 50, **LONG}))
        await wait_for_queue(client, running=1)  # a big prompt in a slot does not count
        waiting = asyncio.create_task(client.post("/generate", json={"prompt": "y" * 15, **LONG}))
        await wait_for_queue(client, running=1, waiting=1)
        rejected = await client.post("/generate", json={"prompt": "z" * 10})
        assert rejected.status_code == 429
        for task in (running, waiting):
            task.cancel()
        await asyncio.gather(running, waiting, return_exceptions=True)


async def test_body_over_the_limit_is_413():
    async with app_client(mock_config(max_body_bytes=2048)) as client:
        response = await client.post("/generate", json={"prompt": "x" * 5000})
        assert response.status_code == 413
        assert response.json()["error"]["type"] == "payload_too_large"

        async def chunks():
            for _ in range(10):
                yield b" " * 500  # no Content-Length: refused while streaming in

        streamed = await client.post("/generate", content=chunks())
        assert streamed.status_code == 413
        assert (
            await client.post("/generate", json={"prompt": "ok", "max_tokens": 1})
        ).status_code == 200


async def test_prompt_and_max_tokens_caps():
    async with app_client(mock_config(max_prompt_tokens=10, max_tokens_cap=5)) as client:
        long_prompt = await client.post("/generate", json={"prompt": "x" * 11, "max_tokens": 1})
        assert long_prompt.status_code == 422 and long_prompt.json()["error"]["param"] == "prompt"
        big = await client.post("/generate", json={"prompt": "x", "max_tokens": 6})
        assert big.status_code == 422 and big.json()["error"]["param"] == "max_tokens"
    # (found by a helper: a cap of 0 was taken as no cap at all)
    with pytest.raises(ValidationError, match="max_tokens_cap"):
        mock_config(max_tokens_cap=0)


def test_flags_that_would_mean_something_else_are_refused():
    """(found by a helper) ``--api-key " , "`` turned authentication off without a word; a
    budget under the slots was refused without the flags' names or values."""
    with pytest.raises(ValidationError, match="holds no key"):
        mock_config(api_key=" , ")
    with pytest.raises(ValidationError, match=r"--max-num-batched-tokens \(1\) must be at least"):
        mock_config(max_num_batched_tokens=1, max_num_seqs=4)


async def test_api_key_required_everywhere_but_health():
    async with app_client(mock_config(api_key="k1,k2")) as client:
        assert (await client.get("/health")).status_code == 200
        for method, path in [
            ("GET", "/info"),
            ("GET", "/metrics"),
            ("POST", "/generate"),
            ("DELETE", "/generate/x"),
        ]:
            response = await client.request(method, path, json={"prompt": "a"})
            assert response.status_code == 401, path
            assert response.json()["error"]["type"] == "unauthorized"
        wrong = await client.get("/info", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        for key in ("k1", "k2"):
            ok = await client.get("/info", headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200


async def test_delete_only_with_the_same_key():
    async with app_client(mock_config(api_key="alice,bob", mock_step_ms=10)) as client:
        alice = {"Authorization": "Bearer alice", "X-Request-Id": "a-job"}
        task = asyncio.create_task(
            client.post("/generate", json={"prompt": "a", **LONG}, headers=alice)
        )
        await wait_for_queue(client, running=1, headers={"Authorization": "Bearer alice"})
        by_bob = await client.delete("/generate/a-job", headers={"Authorization": "Bearer bob"})
        assert by_bob.status_code == 404  # not 403: do not confirm it exists
        by_alice = await client.delete("/generate/a-job", headers={"Authorization": "Bearer alice"})
        assert by_alice.status_code == 200
        assert (await task).json()["finish_reason"] == "cancelled"


async def test_failing_row_fails_only_its_request():
    async with app_client(mock_config(mock_step_ms=5)) as client:
        good = [
            asyncio.create_task(
                client.post("/generate", json={"prompt": f"good {i}", "max_tokens": 30})
            )
            for i in range(3)
        ]
        bad = await client.post("/generate", json={"prompt": "bad <<fail>>", "max_tokens": 30})
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "internal"
        response = await client.post(
            "/generate", json={"prompt": "bad <<fail>>", "max_tokens": 30, "stream": True}
        )
        events = parse_sse(response.text)
        assert response.status_code == 200 and [n for n, _ in events] == ["error"]
        assert events[0][1]["error"]["type"] == "internal"
        for task in good:
            assert (await task).status_code == 200
        assert (
            await metric_value(client, "slotserve_requests_finished_total", finish_reason="error")
            == 2
        )


async def test_failing_step_fails_its_rows_and_the_loop_goes_on():
    model = MockModelRunner(max_num_seqs=4, fail_every=3)
    async with app_client(mock_config(), model=model) as client:
        results = await asyncio.gather(
            *[
                client.post(
                    "/generate", json={"prompt": f"p{i}", "max_tokens": 10, "ignore_eos": True}
                )
                for i in range(4)
            ]
        )
        assert {r.status_code for r in results} <= {200, 500}
        assert any(r.status_code == 500 for r in results)
        model.fail_every = 0
        after = await client.post("/generate", json={"prompt": "after", "max_tokens": 5})
        assert after.status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_dead_loop_turns_health_and_new_requests_to_503(monkeypatch):
    async with app_client(mock_config(mock_step_ms=10)) as client:
        engine = client.app.state.resources.engine
        in_flight = asyncio.create_task(client.post("/generate", json={"prompt": "x", **LONG}))
        await wait_for_queue(client, running=1)

        def broken_schedule():
            raise RuntimeError("scheduler bug")

        monkeypatch.setattr(engine.scheduler, "schedule", broken_schedule)
        monkeypatch.setattr(engine.scheduler, "schedule_ahead", lambda running: broken_schedule())
        response = await asyncio.wait_for(in_flight, 5)
        assert response.status_code == 500  # ended, not hanging
        assert engine.state is EngineState.FAILED
        assert (await client.get("/health")).status_code == 503
        refused = await client.post("/generate", json={"prompt": "y"})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "unavailable"


async def test_delete_racing_admission_finish_and_reuse():
    async with app_client(mock_config(mock_step_ms=2)) as client:
        # DELETE in the same tick as the submit: the request never produces a token
        headers = {"X-Request-Id": "race-1"}
        post = asyncio.create_task(
            client.post("/generate", json={"prompt": "a", **LONG}, headers=headers)
        )
        engine = client.app.state.resources.engine
        await wait_for(lambda: engine.num_in_flight == 1, poll_s=0)  # just submitted
        deleted = await client.delete("/generate/race-1")
        assert deleted.status_code == 200
        assert (await post).json()["finish_reason"] == "cancelled"

        # DELETE racing with finish: exactly one outcome, never both. The DELETE goes out once
        # the request is in flight and has 0, 1, 2 or 3 of its 3 tokens: every point of the race.
        for i in range(20):
            rid = {"X-Request-Id": f"fin-{i}"}
            generated = await metric_value(client, "slotserve_generated_tokens_total")
            post = asyncio.create_task(
                client.post(
                    "/generate",
                    json={"prompt": "b", "max_tokens": 3, "ignore_eos": True},
                    headers=rid,
                )
            )

            async def tokens_out(before: float = generated, wanted: int = i % 4) -> bool:
                now = await metric_value(client, "slotserve_generated_tokens_total")
                return now - before >= wanted

            await wait_for(lambda task=post: engine.num_in_flight == 1 or task.done(), poll_s=0)
            await wait_for(tokens_out)
            deleted = await client.delete(f"/generate/fin-{i}")
            body = (await post).json()
            if deleted.status_code == 200:
                assert body["finish_reason"] == "cancelled"
            else:
                assert deleted.status_code == 404 and body["finish_reason"] == "length"

        # id reused right after DELETE: the new request is independent of the old one
        post = asyncio.create_task(
            client.post("/generate", json={"prompt": "c", **LONG}, headers=headers)
        )
        await wait_for_queue(client, running=1)
        assert (await client.delete("/generate/race-1")).status_code == 200
        reused = await client.post(
            "/generate", json={"prompt": "d", "max_tokens": 4, "ignore_eos": True}, headers=headers
        )
        assert reused.status_code == 200 and reused.json()["usage"]["completion_tokens"] == 4
        assert (await post).json()["finish_reason"] == "cancelled"
        assert await metric_value(client, "slotserve_requests_running") == 0
        assert await metric_value(client, "slotserve_requests_waiting") == 0


async def test_prompt_longer_than_the_context_is_400_not_422():
    async with app_client(mock_config(mock_context_length=64)) as client:
        response = await client.post("/generate", json={"prompt": "x" * 100, "max_tokens": 0})
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "context_length_exceeded"


async def test_max_tokens_zero_is_answered_even_when_the_queue_is_full():
    async with app_client(mock_config(max_num_seqs=1, max_queue=0, mock_step_ms=10)) as client:
        running = asyncio.create_task(client.post("/generate", json={"prompt": "r", **LONG}))
        await wait_for_queue(client, running=1)
        refused = await client.post("/generate", json={"prompt": "waits", "max_tokens": 5})
        assert refused.status_code == 429
        zero = await client.post("/generate", json={"prompt": "abc", "max_tokens": 0})
        assert zero.status_code == 200 and zero.json()["finish_reason"] == "length"
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_api_key_also_hides_the_schema_pages():
    async with app_client(mock_config(api_key="k")) as client:
        for path in ("/openapi.json", "/docs"):
            assert (await client.get(path)).status_code in (401, 404)
        assert (await client.head("/health")).status_code == 200
