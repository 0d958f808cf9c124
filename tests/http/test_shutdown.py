"""SIGTERM to a real server process with open streams: drain, final events, exit 0."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from harness.server import ServerSpec, running
from harness.wait import wait_for

from tests.http.conftest import parse_sse, wait_for_queue

pytestmark = pytest.mark.slow


@pytest.fixture
def server_process(tmp_path):
    spec = ServerSpec.app(
        "drain", "--model", "mock", "--mock-step-ms", "20", "--shutdown-timeout", "1.5"
    )
    with running(spec, tmp_path) as server:
        yield server, server.url


async def test_sigterm_drains_open_streams_and_exits_zero(server_process):
    proc, url = server_process
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:

        async def open_stream(max_tokens: int) -> list[tuple[str, dict]]:
            body = {"prompt": "drain", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            response = await client.post("/generate", json=body)
            return parse_sse(response.text)

        short = asyncio.create_task(open_stream(40))  # ~0.8 s: finishes within the drain
        long = [asyncio.create_task(open_stream(5000)) for _ in range(2)]  # cut at 1.5 s
        await wait_for_queue(client, running=3)
        proc.signal(signal.SIGTERM)
        await wait_for(lambda: draining(client), what="the drain to start")
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
    assert await asyncio.to_thread(proc.wait, 15) == 0, proc.log_tail()


async def test_second_signal_cancels_now_but_still_sends_final_events(tmp_path):
    spec = ServerSpec.app(
        "drain2", "--model", "mock", "--mock-step-ms", "20", "--shutdown-timeout", "60"
    )
    with running(spec, tmp_path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            body = {"prompt": "x", "max_tokens": 5000, "ignore_eos": True, "stream": True}
            stream = asyncio.create_task(client.post("/generate", json=body))
            await wait_for_queue(client, running=1)
            server.signal(signal.SIGTERM)
            await wait_for(lambda: draining(client), what="the drain to start")
            server.signal(signal.SIGTERM)  # do not wait the 60 s drain
            events = parse_sse((await stream).text)
        assert events[-1][0] == "done" and events[-1][1]["finish_reason"] == "cancelled"
        assert await asyncio.to_thread(server.wait, 15) == 0, server.log_tail()


async def draining(client: httpx.AsyncClient) -> bool:
    return (await client.get("/health")).status_code == 503


def test_bad_flag_is_one_line_and_exit_2(forked_cli):
    """``python -m app serve`` as a process of its own, forked from one that imported the app
    once (``tests/forked_cli.py``)."""
    result = forked_cli.run("-m", "app", "serve", "--port", "abc")
    assert result.returncode == 2
    assert "--port" in result.stderr and "Traceback" not in result.stderr


def test_a_signal_while_the_model_loads_exits_at_once(monkeypatch):
    """(found by a helper: a SIGTERM during a 6 s load was honoured only after the load and
    the warm-up, the port opened first.) Before the server has started there is no request to
    drain: the process exits at once, 128 + the signal's number, as before the handler."""
    import uvicorn

    from app.__main__ import DrainingServer

    def exit_now(status: int) -> None:
        raise SystemExit(status)

    monkeypatch.setattr("app.__main__.os._exit", exit_now)
    server = DrainingServer(uvicorn.Config(app=None), drain=lambda timeout_s: asyncio.sleep(0))
    with pytest.raises(SystemExit) as exited:
        server.handle_exit(signal.SIGTERM, None)
    assert exited.value.code == 128 + signal.SIGTERM
