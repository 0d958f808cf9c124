"""``slotserve_event_loop_lag_seconds``: how long the event loop could answer nobody."""

from __future__ import annotations

import asyncio
import time

from tests.http.conftest import app_client, metric_value


async def test_a_blocked_event_loop_shows_in_the_lag_histogram() -> None:
    async with app_client() as client:
        await asyncio.sleep(0.05)  # a few quiet samples
        quiet_count = await metric_value(client, "slotserve_event_loop_lag_seconds_count")
        slow_before = quiet_count - await metric_value(
            client, "slotserve_event_loop_lag_seconds_bucket", le="0.05"
        )
        time.sleep(0.12)  # what a blocking call on the loop would do to every client
        await asyncio.sleep(0.03)
        count = await metric_value(client, "slotserve_event_loop_lag_seconds_count")
        slow = count - await metric_value(
            client, "slotserve_event_loop_lag_seconds_bucket", le="0.05"
        )
    assert quiet_count >= 2
    assert slow >= slow_before + 1  # the sample that waited out the block: > 50 ms late
