"""nginx sticky by conversation (docker/nginx.conf.template): every request carrying one
X-Conversation-Id lands on one replica, and a DELETE by a client-chosen id still finds its
request when the conversation, not the id, chose the replica."""

from __future__ import annotations

import secrets
from collections import defaultdict

import httpx
import pytest
from harness.sse import EventStream

from tests.deploy.conftest import REPLICA_IDS
from tests.deploy.test_nginx import client, in_flight, open_streams  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow


async def test_each_conversation_sticks_to_one_replica(client):  # noqa: F811
    tag = secrets.token_hex(4)
    replicas_of: dict[str, set[str]] = defaultdict(set)
    for turn in range(3):
        for conversation in (f"conv-{tag}-{k}" for k in range(16)):
            body = {"prompt": f"turn {turn} of {conversation}", "max_tokens": 1}
            headers = {"X-Conversation-Id": conversation}
            response = await client.post("/generate", json=body, headers=headers)
            assert response.status_code == 200, response.text
            # A server-made id names its replica ("<replica>-<32 hex>").
            replicas_of[conversation].add(response.headers["x-request-id"].split("-")[0])
    assert all(len(replicas) == 1 for replicas in replicas_of.values()), replicas_of
    # The hash spreads conversations: 16 on one replica alone would be a 1 in 32768 draw.
    assert set().union(*replicas_of.values()) == set(REPLICA_IDS)


async def test_a_client_id_in_a_conversation_is_cancelled_wherever_it_hashes(
    cluster,
    client,  # noqa: F811
):
    tag = secrets.token_hex(4)
    ids = [f"job-{tag}-{i}" for i in range(6)]
    conversation = {"X-Conversation-Id": f"conv-{tag}"}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=20, headers=conversation) as chat:
        async with open_streams(chat, len(ids), ids=ids) as streams:
            holders = await in_flight(cluster)
            assert sorted(holders.values()) == [0, len(ids)], holders  # all on one replica
            for stream in streams:
                await cancel_by_id(client, stream)


async def cancel_by_id(http: httpx.AsyncClient, stream: EventStream) -> None:
    """DELETE without the conversation header: routed by the id's hash, then searched."""
    assert (await stream.next_event()).event == "token"
    deleted = await http.delete(f"/generate/{stream.id}")
    assert deleted.status_code == 200, deleted.text
    final = await stream.final_event()
    assert (final.event, final.json()["finish_reason"]) == ("done", "cancelled")
