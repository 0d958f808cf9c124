"""``python -m app serve [flags]`` and ``python -m app batch -i IN -o OUT [flags]``: the command
line (pydantic-settings parses flags and env)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp, CliSubCommand

from app.api.errors import pydantic_message
from app.batch.config import BatchConfig
from app.config import ServerConfig
from app.models.refusal import ModelRefused

# The flags are parsed before torch and the app are imported (~1.5 s of one core), so that the
# model's memory can be faulted in on the other core meanwhile (Serve.cli_cmd).

logger = logging.getLogger("app")

# The collector's thresholds once the server runs (CPython's defaults: 700, 10, 10). Each open
# stream keeps ~330 container objects alive for its whole life (its tasks, cancel scopes,
# events, generators: mostly sse-starlette's and anyio's), about a second and a half at 128
# tokens. At the defaults they are walked by ~100 young collections a second, promoted, and
# their churn through the old generation starts a full collection about once a second (~60 ms
# each over 512 open streams). Scenario 1 at 256 slots (512 streams, the mock's 10 ms step),
# collection time in each 5 s: 480-580 ms at the defaults, 110-180 ms with these; the longest
# pause 77 against 41-47 ms (docs/ENGINE_LOOP.md). A young collection now comes every 50,000
# net allocations (a few MB of objects), so a garbage cycle (a cancelled task's traceback and
# frames) that dies young waits no longer than that; the old generation is still collected
# on CPython's own rule, now after 200 young collections (about two minutes at that load).
GC_THRESHOLDS = (50_000, 20, 10)


class DrainingServer(uvicorn.Server):
    """uvicorn, but a SIGTERM/SIGINT drains the app before the server stops.

    uvicorn alone would stop listening and wait for open connections without telling the app,
    so streams could outlive the grace period and new requests would be refused at the socket.
    Here:

    1. the first signal starts ``drain(timeout)``: health 503, new requests 503, in-flight
       requests run to the end or, after the timeout, end as cancelled with a final event;
    2. a second signal cuts the wait short: every request ends as cancelled now, still with its
       final event;
    3. a third exits at once.

    After 1 or 2 the server exits normally (status 0) once the final events are sent. A signal
    while the model still loads (the port not open yet, no request taken) exits at once with
    status 128 + the signal's number, as before the handler was installed: the load runs on
    the model thread, and waiting for it kept an orchestrator waiting as long as a load takes.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[float | None], Awaitable[None]],
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._signals = 0

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        # What is alive now (imports, the model, the engine) lives as long as the server. Out of
        # the collector's generations, a full collection no longer walks it: with the mock alone
        # that walk is ~25 ms, during which the event loop answers nothing (a 429 p99 spike).
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.started:  # (found by a helper: a SIGTERM waited for the whole load)
            logger.info("signal received while the model loads: exiting now")
            os._exit(128 + sig)
        self._signals += 1
        if self._signals >= 3:
            self.force_exit = True
            super().handle_exit(sig, frame)
            return
        timeout_s = None if self._signals == 1 else 0.0
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._start_drain, loop, timeout_s)

    def _start_drain(self, loop: asyncio.AbstractEventLoop, timeout_s: float | None) -> None:
        logger.info(
            "signal received: %s",
            "draining before exit" if timeout_s is None else "cancelling every request now",
        )
        loop.create_task(self._drain_then_exit(timeout_s))

    async def _drain_then_exit(self, timeout_s: float | None) -> None:
        try:
            await self._drain(timeout_s)
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
        # A port another process holds would only show after the model has loaded, as
        # uvicorn's multi-line log: say it first, in one line (the bind itself is uvicorn's).
        busy = port_in_use(config.host, config.port)
        if busy is not None:
            print(
                f"python -m app serve: error: cannot listen on {config.host}:{config.port}: {busy}",
                file=sys.stderr,
            )
            raise SystemExit(2)
        _fault_in_the_blocks_ahead(config)
        from app.api.server import create_app, drain_app
        from app.models.loading import inspect_model

        # The model is checked before the port opens: a model that cannot be served is one
        # line naming the path and the reason, and exit status 2 (no traceback, no server).
        try:
            model_plan = inspect_model(config)
        except ModelRefused as refused:
            print(f"python -m app serve: error: {refused}", file=sys.stderr)
            raise SystemExit(2) from None
        app = create_app(config, model_plan=model_plan)
        server = DrainingServer(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                timeout_graceful_shutdown=5,
            ),
            drain=lambda timeout_s: drain_app(
                app, config.shutdown_timeout if timeout_s is None else timeout_s
            ),
        )
        server.run()


def _fault_in_the_blocks_ahead(config: ServerConfig) -> None:
    """Starts faulting in the memory a GGUF model's blocks will be copied into
    (:mod:`app.models.weights.block_arena_prefault`), while the app is imported."""
    if config.quantization not in ("auto", "gguf") or config.device == "cuda":
        return
    from app.models.weights.block_arena_prefault import reserve

    model = config.model
    if model == "smollm2":
        from app.models.load.smollm2 import smollm2_gguf_path

        try:
            model = str(smollm2_gguf_path())
        except (OSError, ImportError):
            return
    reserve(model)


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (``strerror``), or None when it can. Binds
    as uvicorn does (``SO_REUSEADDR``, so a port in TIME_WAIT is free) and closes at once;
    port 0 (any free port) is always free."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as error:
        return str(error)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            return error.strerror or str(error)
    return None


class Batch(BatchConfig):
    """Run an OpenAI Batch API input file (JSONL: custom_id, method, url, body) through the
    engine in this process; one OpenAI batch output line per input line, in input order."""

    def cli_cmd(self) -> None:
        from app.batch import command as batch_command

        raise SystemExit(batch_command.main(self))


class Cli(
    BaseSettings,
    cli_prog_name="python -m app",
    cli_kebab_case=True,
    cli_shortcuts={"input": "i", "output": "o"},
):
    """slotserve: a text-generation server with continuous batching."""

    serve: CliSubCommand[Serve]
    batch: CliSubCommand[Batch]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    """Runs the CLI; a bad flag or env value prints one line per problem and exits 2."""
    try:
        CliApp.run(Cli, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:
        for error in exc.errors():
            command, *field = error["loc"] or ("",)  # the subcommand, then the flag
            prog = f"python -m app {command}".rstrip()
            where = "-".join(str(part) for part in field).replace("_", "-")
            prefix = f"--{where}: " if where else ""
            print(f"{prog}: error: {prefix}{pydantic_message(error)}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
