"""HTTP test fixtures: in-process apps over httpx's ASGI transport, and a real uvicorn."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from app.api.server import create_app
from app.config import ServerConfig
from app.models.base import SamplingParams, StepBatch, StepOutput
from app.models.mock import MockModelRunner


class RecordingMock(MockModelRunner):
    """The mock model, remembering the prompt and sampling of every sequence it started."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.started_prompts: list[bytes] = []
        self.started_sampling: list[SamplingParams] = []

    def step(self, batch: StepBatch) -> StepOutput:
        for row in batch.rows:
            if row.position == 0:
                self.started_prompts.append(bytes(t for t in row.token_ids if t < 256))
                self.started_sampling.append(row.sampling)
        return super().step(batch)


def post_generate_scope(*headers: tuple[bytes, bytes]) -> dict:
    """A raw ASGI scope of ``POST /generate`` (JSON), for tests that drive ``receive``/``send``
    themselves (a client that never reads, one that leaves mid-body)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/generate",
        "raw_path": b"/generate",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


def mock_config(**overrides) -> ServerConfig:
    values = {"model": "mock", "max_num_seqs": 4, "mock_step_ms": 0.0}
    values.update(overrides)
    return ServerConfig(**values)


@asynccontextmanager
async def app_client(
    config: ServerConfig | None = None, *, model=None
) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client talking to a started app in-process (lifespan run)."""
    config = config or mock_config()
    model = model or RecordingMock(
        max_num_seqs=config.max_num_seqs,
        step_ms=config.mock_step_ms,
        context_length=config.mock_context_length,
    )
    app = create_app(config, model=model)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.app = app  # type: ignore[attr-defined]
            client.model = model  # type: ignore[attr-defined]
            yield client


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with app_client() as c:
        yield c


@dataclass
class LiveServer:
    url: str
    model: RecordingMock
    app: object


@pytest.fixture
def live_server_factory() -> Iterator:
    """Starts real uvicorn servers on 127.0.0.1 (random port) in background threads."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(**overrides) -> LiveServer:
        config = mock_config(**overrides)
        model = RecordingMock(
            max_num_seqs=config.max_num_seqs,
            step_ms=config.mock_step_ms,
            context_length=config.mock_context_length,
        )
        app = create_app(config, model=model)
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        for _ in range(500):
            if server.started:
                break
            threading.Event().wait(0.01)
        assert server.started, "uvicorn did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        servers.append((server, thread))
        return LiveServer(url=f"http://127.0.0.1:{port}", model=model, app=app)

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


def parse_sse(text: str) -> list[tuple[str, dict]]:
    """Splits an SSE body into (event, data) pairs; comment lines are skipped."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith(":") or not line:
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        if data:
            events.append((name, json.loads("\n".join(data))))
    return events


async def metric_value(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    """One sample of /metrics, e.g. ``metric_value(c, "slotserve_requests_running")``."""
    body = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
