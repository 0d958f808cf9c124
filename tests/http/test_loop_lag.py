"""``slotserve_event_loop_lag_seconds``: how long the event loop could answer nobody."""

from __future__ import annotations

import time

from harness.wait import wait_for

from tests.http.conftest import app_client, metric_value


async def test_a_blocked_event_loop_shows_in_the_lag_histogram() -> None:
    async with app_client() as client:

        async def samples() -> float:
            return await metric_value(client, "slotserve_event_loop_lag_seconds_count")

        await wait_for(lambda: samples_at_least(samples, 2))  # a few quiet samples
        quiet_count = await samples()
        slow_before = quiet_count - await metric_value(
            client, "slotserve_event_loop_lag_seconds_bucket", le="0.05"
        )
        time.sleep(0.12)  # what a blocking call on the loop would do to every client
        await wait_for(lambda: samples_at_least(samples, quiet_count + 1))  # the late one
        count = await samples()
        slow = count - await metric_value(
            client, "slotserve_event_loop_lag_seconds_bucket", le="0.05"
        )
    assert quiet_count >= 2
    assert slow >= slow_before + 1  # the sample that waited out the block: > 50 ms late


async def samples_at_least(samples, count: float) -> bool:
    return await samples() >= count
