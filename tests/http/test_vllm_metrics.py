"""``/metrics`` under vLLM's names (API.md "Metrics under vLLM's names"): read with
prometheus_client's own parser, each family of the kind vLLM gives it, labelled with the served
model's name, equal to its ``slotserve_*`` twin, and moving with load as vLLM's do."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from harness.metrics import Metrics
from harness.wait import wait_for
from prometheus_client.parser import text_string_to_metric_families

from tests.http.conftest import app_client, parse_sse

# vLLM's family -> (its kind, our family of the same meaning), written out here rather than
# imported, so that a wrong name or kind in app/engine/metrics.py fails this test.
VLLM_FAMILIES = {
    "vllm:num_requests_running": ("gauge", "slotserve_requests_running"),
    "vllm:num_requests_waiting": ("gauge", "slotserve_requests_waiting"),
    "vllm:kv_cache_usage_perc": ("gauge", "slotserve_kv_cache_usage_ratio"),
    "vllm:prefix_cache_queries": ("counter", "slotserve_prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("counter", "slotserve_prefix_cache_hits"),
    "vllm:prompt_tokens": ("counter", "slotserve_prompt_tokens"),
    "vllm:generation_tokens": ("counter", "slotserve_generated_tokens"),
    "vllm:time_to_first_token_seconds": ("histogram", "slotserve_time_to_first_token_seconds"),
    "vllm:inter_token_latency_seconds": ("histogram", "slotserve_inter_token_latency_seconds"),
    "vllm:e2e_request_latency_seconds": ("histogram", "slotserve_request_latency_seconds"),
}
# A shared prefix of several full 16-token KV blocks (the mock is one token per byte).
PREFIX = "You are a careful assistant; answer every question in one short line. "
LONG = {"max_tokens": 4000, "ignore_eos": True, "stream": True}


def families_of(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


async def test_every_vllm_family_is_served_with_its_kind_and_the_model_name() -> None:
    async with app_client() as client:
        await client.post("/generate", json={"prompt": PREFIX, "max_tokens": 3})
        model = (await client.get("/info")).json()["model"]
        families = families_of((await client.get("/metrics")).text)
    for name, (kind, ours) in VLLM_FAMILIES.items():
        assert name in families, f"{name} missing"
        assert families[name].type == kind, name
        assert ours in families, f"{ours} is no longer served"
        samples = families[name].samples
        assert samples and all(s.labels.get("model_name") == model for s in samples), name
    # The counters' samples are called as vLLM's are.
    sample_names = {s.name for f in families.values() for s in f.samples}
    assert {"vllm:prompt_tokens_total", "vllm:generation_tokens_total"} <= sample_names
    assert "vllm:time_to_first_token_seconds_bucket" in sample_names


def assert_twins_agree(metrics: Metrics) -> None:
    """Every vLLM-named sample equals its ``slotserve_*`` twin in the same scrape."""
    for name, (kind, ours) in VLLM_FAMILIES.items():
        suffixes = {"gauge": [""], "counter": ["_total"], "histogram": ["_count", "_sum"]}
        for suffix in suffixes[kind]:
            assert metrics.value(name + suffix) == metrics.value(ours + suffix), name + suffix


async def stream_until_done(http: httpx.AsyncClient, url: str, request_id: str, question: str):
    body = {"prompt": PREFIX + question, **LONG}
    headers = {"X-Request-Id": request_id}
    async with http.stream("POST", url + "/generate", json=body, headers=headers) as response:
        assert response.status_code == 200
        return "".join([chunk async for chunk in response.aiter_text()])


@pytest.mark.parametrize("step_ms", [2.0, 60.0])  # 60: a cancel could beat a first token
async def test_vllm_values_move_with_load(live_server_factory, step_ms: float) -> None:
    server = live_server_factory(max_num_seqs=2, mock_step_ms=step_ms)
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:

        async def scrape() -> Metrics:
            return Metrics.parse((await http.get(server.url + "/metrics")).text)

        async def queue_is(running: int, waiting: int) -> bool:
            now = await scrape()
            queue = (now.value("vllm:num_requests_running"), now.value("vllm:num_requests_waiting"))
            return queue == (running, waiting)

        before = await scrape()
        assert before.value("vllm:num_requests_running") == 0
        assert before.value("vllm:kv_cache_usage_perc") == 0
        streams = [
            asyncio.create_task(stream_until_done(http, server.url, f"load-{i}", f"q{i}?"))
            for i in range(3)
        ]
        try:
            await wait_for(lambda: queue_is(2, 1), 10.0, what="2 running, 1 waiting")
            loaded = await scrape()
            assert loaded.value("vllm:kv_cache_usage_perc") > 0
            await wait_for(
                lambda: _grew(scrape, "vllm:generation_tokens_total", loaded), 10.0, what="tokens"
            )

            # Each request is cancelled once its first token is out (a cancel that comes first
            # wins over the step, and the request has no first token to time).
            async def first_tokens(count: int) -> bool:
                ttft = "vllm:time_to_first_token_seconds_count"
                return _delta(before, await scrape(), ttft) == count

            await wait_for(lambda: first_tokens(2), 10.0, what="the first two's first tokens")
            for request_id in ("load-0", "load-1"):
                assert (await http.delete(f"{server.url}/generate/{request_id}")).status_code == 200
            # The third, admitted after the first two, finds their prefix blocks cached.
            await wait_for(lambda: queue_is(1, 0), 10.0, what="the third admitted")
            await wait_for(lambda: first_tokens(3), 10.0, what="the third's first token")
            assert (await http.delete(f"{server.url}/generate/load-2")).status_code == 200
            texts = await asyncio.wait_for(asyncio.gather(*streams), 10.0)
        finally:
            for stream in streams:
                stream.cancel()
        for text in texts:
            event, data = parse_sse(text)[-1]
            assert (event, data["finish_reason"]) == ("done", "cancelled")
        after = await scrape()

    assert after.value("vllm:num_requests_running") == after.value("vllm:num_requests_waiting") == 0
    assert after.value("vllm:kv_cache_usage_perc") == 0
    prompt_tokens = sum(len((PREFIX + f"q{i}?").encode()) for i in range(3))
    assert _delta(before, after, "vllm:prompt_tokens_total") == prompt_tokens
    assert _delta(before, after, "vllm:generation_tokens_total") > 3
    assert _delta(before, after, "vllm:prefix_cache_queries_total") == prompt_tokens
    full_prefix_blocks = len(PREFIX.encode()) // 16 * 16
    assert _delta(before, after, "vllm:prefix_cache_hits_total") >= full_prefix_blocks
    assert _delta(before, after, "vllm:time_to_first_token_seconds_count") == 3
    assert _delta(before, after, "vllm:e2e_request_latency_seconds_count") == 3
    assert _delta(before, after, "vllm:inter_token_latency_seconds_count") > 0
    for scrape_ in (before, loaded, after):
        assert_twins_agree(scrape_)


def _delta(before: Metrics, after: Metrics, name: str) -> float:
    return after.value(name) - before.value(name)


async def _grew(scrape, name: str, since: Metrics) -> bool:
    return (await scrape()).value(name) > since.value(name)
