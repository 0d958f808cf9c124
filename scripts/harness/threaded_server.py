"""An ASGI app under a real uvicorn on 127.0.0.1, in a thread of this process: for tests that
need real sockets (streaming, disconnects, an SDK) but want the app's objects at hand.

    with serve_in_thread(app) as server:
        httpx.get(server.url + "/health")
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import uvicorn
from starlette.types import ASGIApp

from harness.wait import wait_until

START_TIMEOUT_S = 10.0


class ThreadedServer:
    """uvicorn serving ``app`` on a free port of 127.0.0.1 from a daemon thread.

    Args:
        app: the ASGI app.
        lifespan: uvicorn's ``lifespan`` setting (``"on"`` runs the app's start-up).
    """

    def __init__(self, app: ASGIApp, *, lifespan: Literal["on", "off"] = "on") -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def start(self) -> None:
        """Returns once uvicorn accepts connections (the app's start-up done)."""
        self._thread.start()
        wait_until(lambda: self._server.started, START_TIMEOUT_S, what="uvicorn's start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()


@contextmanager
def serve_in_thread(
    app: ASGIApp, *, lifespan: Literal["on", "off"] = "on"
) -> Iterator[ThreadedServer]:
    server = ThreadedServer(app, lifespan=lifespan)
    server.start()
    try:
        yield server
    finally:
        server.stop()
