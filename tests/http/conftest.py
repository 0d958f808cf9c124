"""HTTP test fixtures: in-process apps over httpx's ASGI transport, and a real uvicorn; waiting
on the server's metrics (``wait_for_queue``), never on time."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
from harness.metrics import scrape
from harness.sse import json_events
from harness.threaded_server import serve_in_thread
from harness.wait import wait_for

from app.api.server import create_app
from app.config import ServerConfig
from app.models.base import SamplingParams, StepBatch, StepOutput
from app.models.mock import MockModelRunner


class RecordingMock(MockModelRunner):
    """The mock model, paged as the server's is (``--model mock``), remembering the prompt (the
    tokens its first row brought) and sampling of every sequence it started."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("kv_blocks", 1 + 16 * -(-kwargs.get("context_length", 8192) // 16))
        super().__init__(**kwargs)
        self.started_prompts: list[bytes] = []
        self.started_sampling: list[SamplingParams] = []

    def step(self, batch: StepBatch) -> StepOutput:
        for row in batch.rows:
            if row.starts_sequence and not row.inert:
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


SMOLLM2_SLOTS = 11  # test_smollm2_http's crowd of ten and its seeded request


@pytest.fixture(scope="session")
def smollm2_runner():
    """SmolLM2 (float32, 11 slots of 512 positions) loaded once for the HTTP tests that serve
    it in-process (test_smollm2_http, test_prefix_cache_http, test_reasoning): each app they
    build over it releases its slots when it stops, and the prefix cache is the engine's, so
    nothing carries from one app to the next."""
    from app.models.load.plan import load_checkpoint

    return load_checkpoint("smollm2", max_num_seqs=SMOLLM2_SLOTS, max_model_len=512)


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
    with ExitStack() as servers:

        def start(**overrides) -> LiveServer:
            config = mock_config(**overrides)
            model = RecordingMock(
                max_num_seqs=config.max_num_seqs,
                step_ms=config.mock_step_ms,
                context_length=config.mock_context_length,
            )
            app = create_app(config, model=model)
            server = servers.enter_context(serve_in_thread(app))
            return LiveServer(url=server.url, model=model, app=app)

        yield start


def parse_sse(text: str) -> list[tuple[str, dict]]:
    """An SSE body as (event, data) pairs; comment lines (pings) are skipped."""
    return json_events(text)


async def metric_value(
    client: httpx.AsyncClient, name: str, *, headers: dict[str, str] | None = None, **labels: str
) -> float:
    """One sample of /metrics, e.g. ``metric_value(c, "slotserve_requests_running")``."""
    return (await scrape(client, headers=headers)).value(name, **labels)


async def wait_for_queue(
    client: httpx.AsyncClient,
    *,
    running: int | None = None,
    waiting: int | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 5.0,
) -> None:
    """Returns once the server's running and waiting gauges hold these values (None: any)."""

    async def reached() -> bool:
        metrics = await scrape(client, headers=headers)
        return (running is None or metrics.value("slotserve_requests_running") == running) and (
            waiting is None or metrics.value("slotserve_requests_waiting") == waiting
        )

    await wait_for(reached, timeout, what=f"running={running} waiting={waiting}")
