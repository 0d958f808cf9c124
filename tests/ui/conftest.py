"""Fixtures of the chat page's tests: a live server (real uvicorn on 127.0.0.1, in a thread) and a
headless Chromium driven by Selenium.

The browser is Debian's ``chromium`` with its ``chromium-driver`` (``.ci/run`` installs both with
apt-get), started by ``scripts/headless_chromium.py``. Where they are missing the browser tests
skip and say why. Screenshots go to ``$SLOTSERVE_UI_ARTIFACTS`` or, unset, to a pytest temporary
folder; the run's summary prints where.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from harness.threaded_server import serve_in_thread
from headless_chromium import ChromiumMissing, find_chromium, headless_chromium
from prometheus_client.parser import text_string_to_metric_families

from app.api.server import create_app
from app.config import ServerConfig
from app.models.base import Model
from tests.ui.scripted_model import ScriptedChatModel

DOM_TIMEOUT_S = 10.0
DOM_POLL_S = 0.02
_recorded: list[Path] = []  # by this process's tests, until their reports carry them


@dataclass
class LiveServer:
    url: str
    model: Model
    app: object

    def metric(self, name: str, api_key: str = "", **labels: str) -> float:
        """One sample of the server's /metrics (0.0 when absent)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        body = httpx.get(f"{self.url}/metrics", headers=headers, timeout=5).text
        return metric_sample(body, name, **labels)


def metric_sample(body: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_until(predicate: Callable[[], object], timeout: float = DOM_TIMEOUT_S, what: str = ""):
    """Polls ``predicate`` (a /metrics read, say) until it is truthy; returns its value."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what or predicate}"
        pause.wait(DOM_POLL_S)


@pytest.fixture
def live_server() -> Iterator[Callable[..., LiveServer]]:
    """``live_server(model=..., **config)``: a started uvicorn on 127.0.0.1 (any free port), the
    harness's in-thread server."""
    with ExitStack() as servers:

        def start(*, model: Model | None = None, **overrides: object) -> LiveServer:
            values: dict[str, object] = {"model": "mock", "max_num_seqs": 4}
            values.update(overrides)
            config = ServerConfig(**values)
            model = model or ScriptedChatModel(max_num_seqs=config.max_num_seqs)
            app = create_app(config, model=model)
            server = servers.enter_context(serve_in_thread(app))
            return LiveServer(url=server.url, model=model, app=app)

        yield start


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """One headless Chromium for the session (each test opens its own server's origin)."""
    try:
        find_chromium()
    except ChromiumMissing as missing:
        pytest.skip(f"{missing}; .ci/run installs them")
    with headless_chromium() as driver:
        yield driver


@pytest.fixture(scope="session")
def artifacts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("SLOTSERVE_UI_ARTIFACTS")
    if configured:
        path = Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("ui-artifacts")


def record_artifact(path: Path) -> None:
    """Lists ``path`` in the run's summary (``tests/conftest.py`` prints it)."""
    _recorded.append(path)
    print(f"saved {path}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """The test's report carries the artifacts it saved, as ``("artifact", path)`` properties:
    the report reaches the process that prints the summary, a pytest-xdist worker's too."""
    outcome = yield
    report = outcome.get_result()
    report.user_properties.extend(("artifact", str(path)) for path in _recorded)
    _recorded.clear()
