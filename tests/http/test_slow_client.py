"""A client that stops reading must not hold up the batch; its send timeout cancels it.

The stalled client is an ASGI ``send`` that never returns once the body started (what a full
socket buffer looks like to the app), driven directly so the test does not need megabytes of
loopback buffers to fill first.
"""

from __future__ import annotations

import asyncio
import json

from harness.wait import wait_for

from tests.http.conftest import app_client, metric_value, mock_config, post_generate_scope


async def test_stalled_reader_is_cancelled_and_others_keep_going():
    config = mock_config(mock_step_ms=5, sse_send_timeout=0.3)
    async with app_client(config) as client:
        app = client.app
        body = json.dumps(
            {"prompt": "stall", "max_tokens": 5000, "ignore_eos": True, "stream": True}
        )
        body_sent = False
        blocked = asyncio.Event()

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body.encode(), "more_body": False}
            await asyncio.Event().wait()  # the client never disconnects by itself

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                blocked.set()
                await asyncio.Event().wait()  # the socket buffer is full: never drains

        stalled = asyncio.create_task(app(post_generate_scope(), receive, send))
        await asyncio.wait_for(blocked.wait(), 5)

        neighbour = await client.post(
            "/generate", json={"prompt": "neighbour", "max_tokens": 40, "ignore_eos": True}
        )
        assert neighbour.status_code == 200  # the batch went on while the stalled send waited

        async def cancelled() -> bool:
            return (
                await metric_value(
                    client, "slotserve_requests_finished_total", finish_reason="cancelled"
                )
                == 1
            )

        await wait_for(cancelled, timeout=5)
        assert await metric_value(client, "slotserve_requests_running") == 0
        stalled.cancel()
        await asyncio.gather(stalled, return_exceptions=True)
