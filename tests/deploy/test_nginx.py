"""Scale-out through nginx: two real replicas (rA, rB) behind the routing of docker/nginx.conf.

Checks that streams pass unbuffered, that DELETE /generate/{id} reaches the replica holding the
request (server-made ids by their replica prefix, client-chosen ids by hash), that a client
leaving through nginx frees the replica's slot, that load spreads over both replicas, and that a
replica draining after SIGTERM finishes its streams while nginx sends new requests elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import pytest
from harness.metrics import scrape
from harness.server import free_port
from harness.sse import EventStream
from harness.wait import wait_for

from tests.deploy.conftest import MOCK_STEP_MS, REPLICA_IDS

pytestmark = pytest.mark.slow

LONG = 2000  # max_tokens of a stream that only a DELETE ends (40 s at 20 ms a step)


@asynccontextmanager
async def open_streams(
    client: httpx.AsyncClient, count: int, *, max_tokens: int = LONG, ids: list[str] | None = None
) -> AsyncIterator[list[EventStream]]:
    """``count`` streams open at once (each past its headers), closed on exit."""
    async with AsyncExitStack() as stack:
        streams = []
        for i in range(count):
            headers = {"X-Request-Id": ids[i]} if ids else {}
            body = {"prompt": f"stream {i}", "max_tokens": max_tokens, "stream": True}
            request = client.build_request(
                "POST", "/generate", json=body | {"ignore_eos": True}, headers=headers
            )
            response = await client.send(request, stream=True)
            stack.push_async_callback(response.aclose)
            assert response.status_code == 200, (await response.aread()).decode()
            streams.append(EventStream(response))
        yield streams


async def cancel_through_nginx(client: httpx.AsyncClient, stream: EventStream) -> None:
    """First token, DELETE by the stream's id via nginx, then the stream ends as cancelled."""
    assert (await stream.next_event()).event == "token"
    deleted = await client.delete(f"/generate/{stream.id}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": stream.id, "status": "cancelled"}
    final = await stream.final_event()
    assert (final.event, final.json()["finish_reason"]) == ("done", "cancelled")
    assert final.json()["id"] == stream.id
    again = await client.delete(f"/generate/{stream.id}")  # routed to the owner again: gone
    assert again.status_code == 404, again.text


async def metric(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        return (await scrape(client)).value(name, **labels)


async def per_replica(cluster, name: str, **labels: str) -> dict[str, float]:
    values = [await metric(url, name, **labels) for url in cluster.replicas.values()]
    return dict(zip(cluster.replicas, values, strict=True))


async def in_flight(cluster) -> dict[str, float]:
    running = await per_replica(cluster, "slotserve_requests_running")
    waiting = await per_replica(cluster, "slotserve_requests_waiting")
    return {rid: running[rid] + waiting[rid] for rid in running}


async def wait_idle(cluster, timeout_s: float = 5.0) -> None:
    async def idle() -> bool:
        return sum((await in_flight(cluster)).values()) == 0

    await wait_for(idle, timeout_s, poll_s=0.05, what="replicas idle")


@pytest.fixture
async def client(cluster) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=20) as c:
        yield c
    await wait_idle(cluster)


async def test_stream_events_pass_nginx_unbuffered(client):
    steps = 60  # 1.2 s of generation at 20 ms a step
    started = time.perf_counter()
    arrivals: list[tuple[str, float]] = []
    body = {"prompt": "unbuffered", "max_tokens": steps, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-accel-buffering"] == "no"
        assert response.headers["x-request-id"].split("-")[0] in REPLICA_IDS
        async for event in EventStream(response):
            arrivals.append((event.event, time.perf_counter() - started))
    first_token = next(t for name, t in arrivals if name == "token")
    last_name, last = arrivals[-1]
    assert last_name == "done"
    assert last >= steps * MOCK_STEP_MS / 1000 * 0.9
    assert first_token < 0.5, f"first token after {first_token:.2f} s: buffered?"
    assert first_token < last / 2, arrivals


async def test_delete_by_server_made_id_reaches_either_replica(client):
    async with open_streams(client, 4) as streams:
        owners = Counter(stream.id.split("-")[0] for stream in streams)
        for stream in streams:
            await cancel_through_nginx(client, stream)
    assert set(owners) == set(REPLICA_IDS), owners  # least_conn: two streams on each


async def test_delete_by_client_chosen_id_reaches_its_replica(cluster, client):
    # Add client-id streams until both replicas hold some (the hash decides which), then cancel
    # each through nginx: a DELETE that reached the other replica would be a 404.
    tag = secrets.token_hex(4)
    async with AsyncExitStack() as stack:
        streams: list[EventStream] = []
        for batch in range(8):
            ids = [f"job-{tag}-{batch}-{i}" for i in range(4)]
            streams += await stack.enter_async_context(open_streams(client, 4, ids=ids))
            holders = await in_flight(cluster)
            if all(holders.values()):
                break
        assert all(holders.values()), f"every client id hashed to one replica: {holders}"
        assert sum(holders.values()) == len(streams)
        for stream in streams:
            assert stream.id.startswith(f"job-{tag}-")
            await cancel_through_nginx(client, stream)


async def test_client_id_in_server_made_form_goes_to_the_named_replica(cluster, client):
    request_id = f"rB-{secrets.token_hex(16)}"
    async with open_streams(client, 1, ids=[request_id]) as (stream,):
        await stream.next_event()
        async with httpx.AsyncClient(base_url=cluster.replicas["rB"]) as rb:
            deleted = await rb.delete(f"/generate/{request_id}")  # directly on rB: it holds it
        assert deleted.status_code == 200, deleted.text
        final = await stream.final_event()
        assert final.json()["finish_reason"] == "cancelled"


async def test_unknown_ids_are_404_in_the_api_error_shape(client):
    for request_id in (f"rZ-{secrets.token_hex(16)}", f"nope-{secrets.token_hex(4)}"):
        response = await client.delete(f"/generate/{request_id}")
        assert response.status_code == 404, response.text
        assert response.json()["error"]["type"] == "not_found"
        assert response.headers["x-request-id"]


async def test_client_leaving_through_nginx_frees_the_replica_slot(cluster, client):
    before = await per_replica(
        cluster, "slotserve_requests_finished_total", finish_reason="cancelled"
    )
    async with open_streams(client, 2) as streams:
        for stream in streams:
            assert (await stream.next_event()).event == "token"
        assert sum((await in_flight(cluster)).values()) == 2
    await wait_idle(cluster, timeout_s=3.0)  # nginx closed the upstream connections
    after = await per_replica(
        cluster, "slotserve_requests_finished_total", finish_reason="cancelled"
    )
    assert sum(after.values()) - sum(before.values()) == 2


async def test_load_spreads_over_both_replicas(cluster, client):
    before = await per_replica(cluster, "slotserve_requests_finished_total", finish_reason="length")
    body = {"prompt": "spread", "max_tokens": 16, "ignore_eos": True}
    responses = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(20)))
    assert [r.status_code for r in responses] == [200] * 20
    by_prefix = Counter(r.json()["id"].split("-")[0] for r in responses)
    after = await per_replica(cluster, "slotserve_requests_finished_total", finish_reason="length")
    by_metrics = {rid: after[rid] - before[rid] for rid in REPLICA_IDS}
    assert by_metrics == {rid: by_prefix[rid] for rid in REPLICA_IDS}
    assert min(by_prefix[rid] for rid in REPLICA_IDS) >= 5, by_prefix


async def test_draining_replica_finishes_streams_while_nginx_uses_the_other(own_cluster):
    cluster = own_cluster
    held_by_a = f"rA-{secrets.token_hex(16)}"  # the server-made form: nginx sends it to rA
    async with httpx.AsyncClient(base_url=cluster.url, timeout=20) as client:
        async with open_streams(client, 1, max_tokens=80, ids=[held_by_a]) as (stream,):
            assert (await stream.next_event()).event == "token"
            cluster.servers["rA"].signal(signal.SIGTERM)
            async with httpx.AsyncClient(base_url=cluster.replicas["rA"]) as replica_a:

                async def draining() -> bool:
                    return (await replica_a.get("/health")).status_code == 503

                await wait_for(draining, 5, what="rA draining")
            body = {"prompt": "while rA drains", "max_tokens": 4}
            answers = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(6)))
            assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
            assert {a.json()["id"].split("-")[0] for a in answers} == {"rB"}
            final = await stream.final_event()
            assert (final.event, final.json()["finish_reason"]) == ("done", "length")
            assert final.json()["usage"]["completion_tokens"] == 80
    assert cluster.servers["rA"].wait(timeout_s=10) == 0


def test_image_healthcheck_command_probes_health(cluster):
    """docker/Dockerfile's HEALTHCHECK command: exit 0 on a serving replica, non-zero without."""
    dockerfile = (Path(__file__).resolve().parents[2] / "docker" / "Dockerfile").read_text()
    command = json.loads(re.search(r"^HEALTHCHECK .*\n\s+CMD (\[.*\])$", dockerfile, re.M)[1])
    assert command[0] == "python"
    port = cluster.replicas["rA"].rsplit(":", 1)[1]
    for probed_port, healthy in ((port, True), (str(free_port()), False)):
        env = {**os.environ, "SLOTSERVE_PORT": probed_port}
        result = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True)
        assert (result.returncode == 0) is healthy, result.stderr
