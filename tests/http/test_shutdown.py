"""SIGTERM to a real server process with open streams: drain, final events, exit 0."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.http.conftest import parse_sse

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server_process():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTSERVE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--model", "mock", "--port", str(port),
         "--mock-step-ms", "20", "--shutdown-timeout", "1.5", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("server did not start: " + proc.stdout.read().decode())
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


async def test_sigterm_drains_open_streams_and_exits_zero(server_process):
    proc, url = server_process
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:

        async def open_stream(max_tokens: int) -> list[tuple[str, dict]]:
            body = {"prompt": "drain", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            response = await client.post("/generate", json=body)
            return parse_sse(response.text)

        short = asyncio.create_task(open_stream(40))  # ~0.8 s: finishes within the drain
        long = [asyncio.create_task(open_stream(5000)) for _ in range(2)]  # cut at 1.5 s
        await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        assert (await client.get("/health")).status_code == 503
        refused = await client.post("/generate", json={"prompt": "late"})
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "unavailable"

        short_events = await short
        assert [n for n, _ in short_events].count("done") == 1
        assert short_events[-1][1]["finish_reason"] == "length"
        for task in long:
            events = await task
            finals = [e for e in events if e[0] in ("done", "error")]
            assert len(finals) == 1 and events[-1] is finals[0]
            assert finals[0][1]["finish_reason"] == "cancelled"
            assert finals[0][1]["usage"]["completion_tokens"] > 0
    assert await asyncio.to_thread(proc.wait, 15) == 0
