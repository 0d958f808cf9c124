"""A port another process listens on stops ``serve`` in one line before the model loads (a new
user's finding: it used to load the model, then end in uvicorn's multi-line bind error)."""

from __future__ import annotations

import socket

from app.__main__ import port_in_use
from tests.http.any_model import REPO


def test_a_busy_port_is_one_line_and_exit_2(forked_cli) -> None:
    """``python -m app serve`` as a process of its own, forked from one that imported the app
    once (``tests/forked_cli.py``)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = forked_cli.run(
            "-m", "app", "serve", "--model", "mock", "--port", str(port), cwd=REPO, timeout=300
        )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"python -m app serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_a_free_port_and_port_zero_are_free() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert port_in_use("127.0.0.1", port) is None
    assert port_in_use("127.0.0.1", 0) is None
