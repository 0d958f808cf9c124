"""The admission gate (``app.api.admission_gate``): when the engine is full, a generating POST
gets the route's own refusal without reaching FastAPI; anything else reaches the route intact.
Every POST route is either gated (a generating route of ``app.api.request_path``) or never
refused as overloaded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from app.api import admission, admission_gate, request_path
from app.api.server import create_app
from tests.http.conftest import app_client, metric_value, mock_config, wait_for_queue

LONG = {"max_tokens": 200, "ignore_eos": True}
CHAT = [{"role": "user", "content": "refused"}]
# a valid body for every generating route (the gated ones)
ROUTES = {
    "/generate": {"prompt": "refused", "max_tokens": 5},
    "/v1/completions": {"model": "mock", "prompt": "refused", "max_tokens": 5},
    "/v1/chat/completions": {"model": "mock", "messages": CHAT, "max_tokens": 5},
    "/v1/responses": {"model": "mock", "input": "refused", "max_output_tokens": 5},
    "/v1/messages": {"model": "mock", "messages": CHAT, "max_tokens": 5},
}
# and for every other POST route: none of them is ever refused as overloaded
UNGATED = {
    "/tokenize": {"prompt": "not refused"},
    "/detokenize": {"tokens": [104, 105]},
    "/v1/messages/count_tokens": {"model": "mock", "messages": CHAT},
}


@asynccontextmanager
async def overloaded(**overrides) -> AsyncIterator[httpx.AsyncClient]:
    """A client whose server has its one slot busy and no room to wait (max_queue 0)."""
    config = mock_config(max_num_seqs=1, max_queue=0, mock_step_ms=10, **overrides)
    headers = {"Authorization": f"Bearer {overrides['api_key']}"} if "api_key" in overrides else {}
    async with app_client(config) as client:
        running = asyncio.create_task(
            client.post("/generate", json={"prompt": "holds the slot", **LONG}, headers=headers)
        )
        await wait_for_queue(client, running=1, headers=headers)
        try:
            yield client
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


@pytest.fixture
def route_checks(monkeypatch) -> list[int | None]:
    """Each admission check a route ran itself (``refuse_if_overloaded`` on the request path),
    as the ``max_tokens`` it was given (None for a route that checks before reading the body)."""
    checks: list[int | None] = []

    def recorded(resources, *, max_tokens=None):
        checks.append(max_tokens)
        admission.refuse_if_overloaded(resources, max_tokens=max_tokens)

    monkeypatch.setattr(request_path, "refuse_if_overloaded", recorded)
    return checks


def gate_off(monkeypatch) -> None:
    monkeypatch.setattr(admission_gate, "WIRE_FORMATS", {})


def comparable(response: httpx.Response) -> tuple[int, dict[str, str], bytes]:
    return response.status_code, dict(response.headers), response.content


@pytest.mark.parametrize("path", sorted(ROUTES))
async def test_gate_answers_429_exactly_as_the_route_would(path, route_checks, monkeypatch):
    async with overloaded() as client:
        route_checks.clear()  # the request holding the slot passed its route's check
        headers = {"X-Request-Id": "refused-1"}
        gated = await client.post(path, json=ROUTES[path], headers=headers)
        assert route_checks == []  # answered in front of FastAPI
        assert gated.status_code == 429
        assert gated.headers["retry-after"] == "1"
        assert gated.headers["x-request-id"] == "refused-1"
        error = gated.json()["error"]
        if path == "/v1/messages":  # Anthropic's shape
            assert gated.json()["type"] == "error" and error["type"] == "rate_limit_error"
            assert set(error) == {"type", "message"}
        elif path.startswith("/v1/"):
            assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
            assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
        else:
            assert error["type"] == "overloaded" and set(error) == {"type", "message", "param"}
            assert error["param"] is None
        gate_off(monkeypatch)
        routed = await client.post(path, json=ROUTES[path], headers=headers)
        assert len(route_checks) == 1  # this time the route refused it
        assert comparable(gated) == comparable(routed)
        assert (
            await metric_value(client, "slotserve_requests_rejected_total", type="overloaded") == 2
        )


async def test_max_tokens_zero_passes_the_gate_with_its_body(route_checks):
    async with overloaded() as client:
        route_checks.clear()
        prompt = "zero " * 40

        async def chunks():  # several body messages, no Content-Length: all must be replayed
            body = f'{{"prompt": "{prompt}", "max_tokens": 0}}'.encode()
            for start in range(0, len(body), 16):
                yield body[start : start + 16]

        for content in (f'{{"prompt": "{prompt}", "max_tokens": 0}}'.encode(), chunks()):
            response = await client.post("/generate", content=content)
            assert response.status_code == 200
            assert response.json()["finish_reason"] == "length"
            assert response.json()["usage"]["prompt_tokens"] == len(prompt.encode())
        assert route_checks == [0, 0]


async def test_body_the_route_refuses_first_passes_the_gate(route_checks):
    async with overloaded(max_body_bytes=2048) as client:
        route_checks.clear()
        unknown_field = await client.post("/generate", json={"prompt": "a", "colour": "red"})
        assert unknown_field.status_code == 422
        assert unknown_field.json()["error"]["param"] == "colour"
        assert (await client.post("/generate", content=b"{not json")).status_code == 422

        async def too_long():  # over the limit while streaming in: the route still sees it all
            for _ in range(10):
                yield b" " * 500

        assert (await client.post("/generate", content=too_long())).status_code == 413
        declared = await client.post("/generate", json={"prompt": "x" * 5000})
        assert declared.status_code == 413
        assert route_checks == []  # the routes answered before their admission check
        assert (
            await metric_value(client, "slotserve_requests_rejected_total", type="overloaded") == 0
        )


@pytest.mark.parametrize("path", sorted(ROUTES))
async def test_missing_key_is_401_before_429(path, route_checks):
    async with overloaded(api_key="k1") as client:
        route_checks.clear()
        unauthorized = await client.post(path, json=ROUTES[path])
        assert unauthorized.status_code == 401
        if path != "/v1/messages":  # Anthropic's 401 names no scheme
            assert unauthorized.headers["www-authenticate"] == "Bearer"
        keyed = await client.post(path, json=ROUTES[path], headers={"Authorization": "Bearer k1"})
        assert keyed.status_code == 429
        assert route_checks == []


@pytest.mark.parametrize("path", sorted(ROUTES))
async def test_gate_answers_503_while_draining_as_the_route_would(path, monkeypatch):
    async with app_client(mock_config()) as client:
        await client.app.state.resources.engine.drain(0)
        headers = {"X-Request-Id": "drained-1"}
        gated = await client.post(path, json=ROUTES[path], headers=headers)
        assert gated.status_code == (529 if path == "/v1/messages" else 503)  # Anthropic's 503
        gate_off(monkeypatch)
        assert comparable(gated) == comparable(
            await client.post(path, json=ROUTES[path], headers=headers)
        )


async def test_gate_lets_everything_through_while_requests_are_taken(route_checks):
    async with app_client(mock_config()) as client:
        for path, body in ROUTES.items():
            assert (await client.post(path, json=body)).status_code == 200
        assert route_checks == [5, None, None, None, None]  # /generate's after its body


def test_every_post_route_is_gated_or_ungated():
    """A new POST route must be named here: in ROUTES, and then in the gate's table, or in
    UNGATED, and then never refused (``test_ungated_routes_are_never_refused``)."""
    paths = create_app(mock_config(ui=True)).openapi()["paths"]
    posts = {path for path, operations in paths.items() if "post" in operations}
    assert posts == set(ROUTES) | set(UNGATED)
    assert set(request_path.WIRE_FORMATS) == set(ROUTES)


async def test_ungated_routes_are_never_refused(route_checks):
    async with overloaded() as client:
        route_checks.clear()
        for path, body in UNGATED.items():
            response = await client.post(path, json=body)
            assert response.status_code == 200, (path, response.text)
        assert route_checks == []
        assert (
            await metric_value(client, "slotserve_requests_rejected_total", type="overloaded") == 0
        )
