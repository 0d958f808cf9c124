"""Against a real uvicorn on 127.0.0.1: streaming and client disconnects."""

from __future__ import annotations

import asyncio
import gc

import httpx
import pytest
from harness.sse import EventStream
from harness.wait import wait_for

from tests.http.conftest import metric_value, wait_for_queue

pytestmark = pytest.mark.slow


async def test_stream_disconnect_after_three_events_frees_the_slot(live_server_factory):
    server = live_server_factory(mock_step_ms=20, max_num_seqs=2)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        body = {"prompt": "disconnect me", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for event in EventStream(response):
                assert event.event == "token", event
                seen += 1
                if seen == 3:
                    break

        # the connection is closed here, mid-stream
        async def running_is_zero() -> bool:
            return await metric_value(client, "slotserve_requests_running") == 0

        await wait_for(running_is_zero, timeout=3)
        cancelled = await metric_value(
            client, "slotserve_requests_finished_total", finish_reason="cancelled"
        )
        assert cancelled == 1
        generated = await metric_value(client, "slotserve_generated_tokens_total")
        assert generated < 100  # it stopped, it did not run to 2000


async def test_non_stream_client_timeout_frees_the_slot(live_server_factory, caplog):
    """... and leaves no "exception was never retrieved" in the log (found: the wait for the
    request's final event, cancelled when the client left, logged a CancelledError traceback
    per such request when it was collected)."""
    server = live_server_factory(mock_step_ms=20, max_num_seqs=2)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        body = {"prompt": "slow", "max_tokens": 2000, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/generate", json=body, timeout=0.3)

        async def slot_freed() -> bool:
            return (
                await metric_value(
                    client, "slotserve_requests_finished_total", finish_reason="cancelled"
                )
                == 1
                and await metric_value(client, "slotserve_requests_running") == 0
            )

        await wait_for(slot_freed, timeout=3)
    gc.collect()  # an unretrieved future's error is logged when it is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_queued_request_whose_client_left_never_runs(live_server_factory):
    server = live_server_factory(mock_step_ms=20, max_num_seqs=1)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        blocker = asyncio.create_task(
            client.post(
                "/generate", json={"prompt": "blocker", "max_tokens": 40, "ignore_eos": True}
            )
        )
        await wait_for_queue(client, running=1)
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/generate", json={"prompt": "impatient"}, timeout=0.2)
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream(
                "POST",
                "/generate",
                json={"prompt": "impatient stream", "stream": True},
                timeout=0.2,
            ) as response:
                async for event in EventStream(response):
                    raise AssertionError(f"a queued request whose client left sent {event}")
        assert (await blocker).status_code == 200

        async def both_left() -> bool:
            cancelled = await metric_value(
                client, "slotserve_requests_finished_total", finish_reason="cancelled"
            )
            return cancelled == 2

        await wait_for(both_left, timeout=3)
        await wait_for_queue(client, running=0, waiting=0)
        assert server.model.started_prompts == [b"blocker"]
        assert await metric_value(client, "slotserve_requests_waiting") == 0


async def test_delete_ends_a_long_stream_with_cancelled(live_server_factory):
    server = live_server_factory(mock_step_ms=10)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        events = []
        async with client.stream(
            "POST", "/generate", json=body, headers={"X-Request-Id": "s1"}
        ) as response:
            async for event in EventStream(response):
                events.append(event.event)
                if len(events) == 5:
                    assert (await client.delete("/generate/s1")).status_code == 200
                if event.event == "done":
                    assert event.json()["finish_reason"] == "cancelled"
        assert events[-1] == "done"
        assert events.count("done") == 1


async def test_first_event_arrives_before_generation_ends(live_server_factory):
    server = live_server_factory(mock_step_ms=20)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        body = {"prompt": "tick", "max_tokens": 50, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/generate", json=body) as response:
            first_event = await EventStream(response).next_event()
            first = loop.time() - started
        assert first_event.event == "token", first_event
        assert first < 0.5  # 50 steps x 20 ms = 1 s for the whole answer


async def test_queued_stream_gets_pings(live_server_factory):
    server = live_server_factory(mock_step_ms=20, max_num_seqs=1, sse_ping_interval=0.2)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        blocker = asyncio.create_task(
            client.post(
                "/generate", json={"prompt": "blocker", "max_tokens": 40, "ignore_eos": True}
            )
        )
        await wait_for_queue(client, running=1)
        # Raw lines on purpose: a ping is an SSE comment, which httpx-sse (harness.sse) skips.
        lines = []
        body = {"prompt": "queued", "max_tokens": 2, "stream": True}
        async with client.stream("POST", "/generate", json=body) as response:
            async for line in response.aiter_lines():
                lines.append(line)
                if line.startswith("event: token"):
                    break
        await blocker
        first_token = lines.index("event: token")
        assert ": ping" in lines[:first_token]  # kept alive while it waited for the slot
