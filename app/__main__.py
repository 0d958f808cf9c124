"""``python -m app serve [flags]``: the command line (pydantic-settings parses flags and env)."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic_settings import BaseSettings, CliApp, CliSubCommand

from app.api.server import create_app
from app.config import ServerConfig


class Serve(ServerConfig):
    """Serve the HTTP API (every flag also reads SLOTSERVE_<FLAG> from the environment)."""

    def cli_cmd(self) -> None:
        logging.basicConfig(
            level=self.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        config = ServerConfig(**self.model_dump())
        uvicorn.run(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=config.shutdown_timeout + 5,
        )


class Cli(BaseSettings, cli_prog_name="python -m app", cli_kebab_case=True):
    """slotserve: a text-generation server with continuous batching."""

    serve: CliSubCommand[Serve]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    CliApp.run(Cli, cli_args=sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
