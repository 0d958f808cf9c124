"""One SmolLM2 server (real uvicorn on 127.0.0.1) for every structured-output test that needs
the real model: loaded once per session, 16 slots, so a corpus of requests runs as one wave."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from harness.threaded_server import serve_in_thread

from app.api.server import create_app
from app.models.load.plan import load_checkpoint
from tests.http.conftest import mock_config

SMOLLM2_SLOTS = 16


@dataclass(frozen=True)
class SmolServer:
    url: str
    app: object


@pytest.fixture(scope="session")
def smollm2_server() -> Iterator[SmolServer]:
    runner = load_checkpoint("smollm2", max_num_seqs=SMOLLM2_SLOTS, max_model_len=1024)
    app = create_app(mock_config(max_num_seqs=SMOLLM2_SLOTS), model=runner)
    with serve_in_thread(app) as server:
        yield SmolServer(url=server.url, app=app)
