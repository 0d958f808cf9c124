"""Fuzz every operation of the app's own OpenAPI schema with schemathesis' data generation.

Positive (schema-valid) and negative (schema-violating) requests, plus arbitrary bytes as bodies.
Whatever comes in: no 5xx, the one error shape on every error, no stack trace, still healthy.
One started app serves every example of an operation (its lifespan cost ~10x a request's), so
each example also meets the state the ones before it left behind.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from app.api.server import create_app
from tests.http.conftest import RecordingMock, app_client, mock_config

pytestmark = pytest.mark.slow


def _schema():
    app = create_app(mock_config(), model=RecordingMock(max_num_seqs=2))
    return schemathesis.openapi.from_dict(app.openapi())


SCHEMA = _schema()
OPERATIONS = [
    (result.ok().method.upper(), result.ok().path) for result in SCHEMA.get_all_operations()
]
# Negative generation needs something to break; operations without a body or parameters
# (GET /health) have nothing, and a free-form string path parameter has no invalid value.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"
]


def _check(response, path: str) -> None:
    assert response.status_code < 500, response.text
    assert "Traceback" not in response.text and 'File "' not in response.text
    assert response.headers.get("x-request-id")
    if response.status_code >= 400:
        body = response.json()
        if path.startswith("/v1/messages"):  # Anthropic's shape
            assert body["type"] == "error" and {"type", "message"} <= set(body["error"])
        else:
            assert {"type", "message", "param"} <= set(body["error"])


def _cheap(body):
    """Keep valid generations cheap: few tokens, and no SSE (parsed elsewhere)."""
    if isinstance(body, dict):
        body = dict(body)
        if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
            body["max_tokens"] = (
                min(body["max_tokens"], 4) if body["max_tokens"] >= 0 else body["max_tokens"]
            )
        if body.get("stream") is True:
            body["stream"] = False
    return body


async def _send(client, method: str, path: str, raw: bytes | None) -> None:
    response = await client.request(
        method, path, content=raw, headers={"Content-Type": "application/json"}
    )
    _check(response, path)
    assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "mode"), CASES, ids=[f"{g.value}-{m} {p}" for m, p, g in CASES]
)
def test_fuzz_operation(method, path, mode):
    operation = SCHEMA[path][method]
    cases = operation.as_strategy(generation_mode=mode)
    raw_bodies = st.one_of(st.none(), st.binary(max_size=48))

    @settings(
        max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    @given(case=cases, junk=raw_bodies, use_junk=st.booleans())
    def run(case, junk, use_junk):
        url = (
            case.formatted_path
            if hasattr(case, "formatted_path")
            else path.format(**(case.path_parameters or {}))
        )
        if method in ("POST", "PUT", "PATCH") and use_junk and junk is not None:
            raw = junk
        elif isinstance(case.body, bytes):
            raw = case.body
        elif case.body is not None and not isinstance(case.body, schemathesis.core.NotSet):
            raw = json.dumps(_cheap(case.body), default=str).encode()
        else:
            raw = None
        loop.run(_send(client, method, url, raw))

    with asyncio.Runner() as loop:
        started = app_client(mock_config(max_num_seqs=2))
        client = loop.run(started.__aenter__())
        try:
            run()
        finally:
            loop.run(started.__aexit__(None, None, None))
