"""Prefix caching through the server: /info and /metrics say what it did, nothing stays held,
and a cached prefix never changes a seeded request's tokens (API.md's seed promise)."""

from __future__ import annotations

import pytest

from tests.http.conftest import app_client, metric_value, mock_config

PREFIX = "You are a terse assistant. Reply with one word, never more, whatever is asked. " * 2


async def test_info_reports_the_block_pool_and_prefix_caching() -> None:
    async with app_client() as client:
        info = (await client.get("/info")).json()
    assert info["kv_block_size"] == 16 and info["num_kv_blocks"] >= 16
    assert info["prefix_caching"] is True
    async with app_client(mock_config(prefix_caching=False)) as client:
        assert (await client.get("/info")).json()["prefix_caching"] is False


async def test_a_shared_prefix_is_hit_and_no_block_stays_held() -> None:
    async with app_client() as client:
        for question in ("a?", "b?", "c?"):
            body = {"prompt": PREFIX + question, "max_tokens": 4}
            assert (await client.post("/generate", json=body)).status_code == 200
        hits = await metric_value(client, "slotserve_prefix_cache_hits_total")
        queries = await metric_value(client, "slotserve_prefix_cache_queries_total")
        usage = await metric_value(client, "slotserve_kv_cache_usage_ratio")
    full = len(PREFIX.encode()) // 16 * 16
    assert queries == 3 * (len(PREFIX.encode()) + 2)
    assert hits == 2 * full
    assert usage == 0.0


@pytest.mark.slow
async def test_a_cached_prefix_does_not_change_a_seeded_requests_tokens(smollm2_runner) -> None:
    seeded = {"max_tokens": 10, "temperature": 0.8, "seed": 77, "ignore_eos": True}
    prompts = [PREFIX + "What colour is the sky?", PREFIX + "What colour is grass?"]
    async with app_client(mock_config(prefix_caching=False), model=smollm2_runner) as client:
        reference = [
            (await client.post("/generate", json={**seeded, "prompt": p})).json()["token_ids"]
            for p in prompts
        ]
    async with app_client(mock_config(), model=smollm2_runner) as client:
        # An unseeded request computes the prefix the fast way: a seeded one must not use it.
        unseeded = {"prompt": prompts[0], "max_tokens": 10, "temperature": 0.8}
        assert (await client.post("/generate", json=unseeded)).status_code == 200
        answers = [
            (await client.post("/generate", json={**seeded, "prompt": p})).json()["token_ids"]
            for p in (*prompts, prompts[0])
        ]
        hits = await metric_value(client, "slotserve_prefix_cache_hits_total")
        usage = await metric_value(client, "slotserve_kv_cache_usage_ratio")
    assert answers == [*reference, reference[0]]
    assert hits >= 3 * 16  # the unseeded request's own blocks, then the seeded ones'
    assert usage == 0.0
