"""The real model through the HTTP stack: seeded sampling is batch-invariant, text is sane."""

from __future__ import annotations

import asyncio

import pytest

from tests.http.conftest import app_client, mock_config, wait_for_queue

pytestmark = pytest.mark.slow


async def test_greedy_answer_mentions_paris(smollm2_runner):
    async with app_client(mock_config(max_num_seqs=11), model=smollm2_runner) as client:
        response = await client.post(
            "/generate",
            json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        )
        assert response.status_code == 200
        assert "Paris" in response.json()["text"]


async def test_seeded_request_alone_equals_in_a_crowd_of_ten(smollm2_runner):
    seeded = {
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 1234,
        "ignore_eos": True,
    }
    async with app_client(mock_config(max_num_seqs=11), model=smollm2_runner) as client:
        alone = (await client.post("/generate", json=seeded)).json()
        crowd_prompts = [
            f"Tell me about topic number {i} and why it matters" * (1 + i % 3) for i in range(10)
        ]
        crowd = [
            asyncio.create_task(
                client.post(
                    "/generate",
                    json={"prompt": p, "max_tokens": 16, "temperature": 1.0, "ignore_eos": True},
                )
            )
            for p in crowd_prompts
        ]
        await wait_for_queue(client, running=len(crowd), timeout=60)  # all in their slots
        in_crowd = (await client.post("/generate", json=seeded)).json()
        await asyncio.gather(*crowd)
    assert alone["token_ids"] == in_crowd["token_ids"]
    assert alone["text"] == in_crowd["text"]


async def test_stream_equals_non_stream_on_multibyte_text(smollm2_runner):
    body = {
        "prompt": "Translate to Japanese and add emoji: good morning",
        "max_tokens": 24,
        "temperature": 0,
    }
    async with app_client(mock_config(max_num_seqs=11), model=smollm2_runner) as client:
        plain = (await client.post("/generate", json=body)).json()
        response = await client.post("/generate", json={**body, "stream": True})
    from tests.http.conftest import parse_sse

    events = parse_sse(response.text)
    streamed = "".join(d["text"] for name, d in events if name == "token")
    assert streamed == plain["text"]
    assert "\ufffd" not in streamed
