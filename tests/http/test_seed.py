"""A client-chosen seed asks the model for batch-invariant rows (API.md, ``seed``); a request
without one gets a random seed and the fast path."""

from __future__ import annotations

import pytest

from tests.http.conftest import app_client

ROUTES = [
    ("/generate", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/completions", {"model": "mock", "prompt": "hi", "max_tokens": 2}),
    (
        "/v1/chat/completions",
        {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ),
]


@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_only_a_client_seed_asks_for_batch_invariance(path: str, body: dict) -> None:
    async with app_client() as client:
        seeded = await client.post(path, json={**body, "seed": 42, "temperature": 0.7})
        unseeded = await client.post(path, json={**body, "temperature": 0.7})
        assert seeded.status_code == unseeded.status_code == 200
        first, second = client.model.started_sampling  # type: ignore[attr-defined]
    assert (first.seed, first.batch_invariant) == (42, True)
    assert second.batch_invariant is False
    assert 0 <= second.seed < 2**63
