"""``python -m app serve [flags]``: the command line (pydantic-settings parses flags and env)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from pydantic_settings import BaseSettings, CliApp, CliSubCommand

from app.api.server import create_app, drain_app
from app.config import ServerConfig

logger = logging.getLogger("app")


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains the app before the server stops.

    uvicorn alone would stop listening and wait for open connections without telling the app,
    so streams could outlive the grace period and new requests would be refused at the socket.
    Here, the first signal starts ``drain`` (health 503, new requests 503, in-flight requests
    finish or are cancelled with a final event), then uvicorn exits normally (status 0).
    A second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None:
            self.force_exit = True
            super().handle_exit(sig, frame)
            return
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._start_drain, loop)

    def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._drain_task is None:
            logger.info("signal received: draining before exit")
            self._drain_task = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:
            logger.exception("drain failed")
        finally:
            self.should_exit = True


class Serve(ServerConfig):
    """Serve the HTTP API (every flag also reads SLOTSERVE_<FLAG> from the environment)."""

    def cli_cmd(self) -> None:
        logging.basicConfig(
            level=self.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        config = ServerConfig(**self.model_dump())
        app = create_app(config)
        server = DrainingServer(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                timeout_graceful_shutdown=5,
            ),
            drain=lambda: drain_app(app, config.shutdown_timeout),
        )
        server.run()


class Cli(BaseSettings, cli_prog_name="python -m app", cli_kebab_case=True):
    """slotserve: a text-generation server with continuous batching."""

    serve: CliSubCommand[Serve]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    CliApp.run(Cli, cli_args=sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
