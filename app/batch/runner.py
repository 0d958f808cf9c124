"""One batch run: the server's engine in this process, the input fed in, the results written out.

Engine: the server's own ``AsyncEngine`` (its model thread, inbox, scheduler and finish funnel),
not ``SyncEngine``. Reasons: the batch is then literally the ``/v1`` routes' path without HTTP
(``submit``, a ``RequestHandle``, the final event, the same failure handling); the work around
the model (JSON parsing, validation, tokenizing, the answer's JSON, the file writes) runs on
the event loop while the model step runs on the model thread, instead of between steps; and
reading the input on its own thread never holds the requests already in flight back (with
``SyncEngine`` the one thread would block in a read on a slow standard input).

Two loops share a ``ReorderBuffer`` of ``--max-pending-lines`` lines:

    feed:  input line -> LineParser (envelope) -> a task answering it (BatchEndpoints)
           -> the buffer, in input order (waits while the buffer is full)
    write: the buffer's results in input order -> the output file, flushed whenever the next
           result is not ready yet -> the tally and the bar

So every request read is in flight at once up to the slots (the engine's queue holds the rest
of the window), lines finish in any order and are written in input order, and the memory is
bounded by the window: at most ``--max-pending-lines`` requests and results, plus the reader's
read-ahead (``app.batch.reader``). A reading failure ends the feed; the lines before it are
still answered and written, then the run fails with the reader's message.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import sys
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

from app.api.resources import ServerResources
from app.batch.config import STDIO, BatchConfig
from app.batch.endpoints import BatchEndpoints
from app.batch.progress import BatchProgress, BatchTally, count_requests
from app.batch.reader import InputError, InputLine, LineReader
from app.batch.requests import BatchRequest, LineError, LineParser, max_line_bytes
from app.batch.results import Answered, ReorderBuffer, encode_line
from app.config import ServerConfig
from app.engine.chat_template import template_override
from app.engine.engine import AdmissionLimits, AsyncEngine
from app.engine.model_thread import ModelThread
from app.engine.policy import make_policy
from app.engine.speculation import NgramSpeculation
from app.models.base import Model
from app.models.loading import load_model

logger = logging.getLogger(__name__)


class BatchFailed(Exception):
    """The run cannot go on (input unreadable, output unwritable, model not loadable); the
    message is one line for the user."""


class BatchRunner:
    """Feeds one input through the endpoints and writes the results in order.

    Args:
        endpoints: answers each request as the ``/v1`` routes would.
        parser: checks each line's envelope (owns the custom ids seen).
        max_pending_lines: the reorder buffer's capacity (the window).
    """

    def __init__(
        self, endpoints: BatchEndpoints, parser: LineParser, *, max_pending_lines: int
    ) -> None:
        self._endpoints = endpoints
        self._parser = parser
        self._max_pending_lines = max_pending_lines

    async def run(
        self,
        reader: LineReader,
        sink: BinaryIO,
        *,
        sink_name: str,
        tally: BatchTally,
        progress: BatchProgress,
    ) -> None:
        """Every input line answered and written, in input order.

        Raises:
            BatchFailed: reading the input or writing ``sink`` failed (what came before the
                failure is written).
        """
        buffer = ReorderBuffer(self._max_pending_lines)
        feeding = asyncio.create_task(self._feed(reader, buffer, progress), name="batch-feed")
        try:
            await self._write(buffer, sink, sink_name, tally, progress)
        except BaseException:
            feeding.cancel()
            buffer.cancel()
            await asyncio.gather(feeding, return_exceptions=True)
            raise
        input_error = await feeding  # done: the buffer closes only when the feed ends
        if input_error is not None:
            raise BatchFailed(str(input_error))

    async def _feed(
        self, reader: LineReader, buffer: ReorderBuffer, progress: BatchProgress
    ) -> InputError | None:
        """Reads and dispatches every line; returns the input's failure, if reading failed.
        At the end of the input the bar learns the total (standard input has no other)."""
        fed = 0
        try:
            async for raw in reader.lines():
                if isinstance(raw, InputLine) and not raw.data.strip():
                    continue  # a blank line, as vLLM's run-batch skips them
                fed += 1
                await buffer.wait_for_room()
                parsed = self._parser.parse(raw)
                if isinstance(parsed, LineError):
                    buffer.add(parsed)
                else:
                    buffer.add(asyncio.create_task(self._answer(parsed)))
        except InputError as exc:
            return exc
        finally:
            buffer.close()
        progress.set_total(fed)
        return None

    async def _answer(self, request: BatchRequest) -> Answered:
        return Answered(request.line, request.custom_id, await self._endpoints.answer(request))

    async def _write(
        self,
        buffer: ReorderBuffer,
        sink: BinaryIO,
        sink_name: str,
        tally: BatchTally,
        progress: BatchProgress,
    ) -> None:
        try:
            async for result in buffer.in_order():
                sink.write(encode_line(result))
                tally.count(result)
                progress.show()
                if not buffer.head_is_ready:
                    sink.flush()  # what is done is in the file while the next line runs
            sink.flush()
        except OSError as exc:
            raise BatchFailed(f"cannot write {sink_name}: {exc.strerror or exc}") from None


async def run_batch(
    config: BatchConfig,
    tally: BatchTally,
    progress: BatchProgress,
    *,
    model: Model | None = None,
) -> None:
    """Runs ``config.input`` into ``config.output`` on a model loaded as ``serve`` loads it
    (or on ``model``, already built: tests), counting into ``tally``, shown by ``progress``.

    Raises:
        BatchFailed: the input cannot be read, the output cannot be written, or the model
            cannot be loaded (nothing is written then).
        pydantic.ValidationError: a combination of flags the server refuses.
    """
    server_config = config.server_config()
    with ExitStack() as files:
        source, source_name, source_path = _open_input(config.input, files)
        sink, sink_name, created = _open_output(config.output, source_path, files)
        try:
            engine = await _start_engine(server_config, config.max_pending_lines, model)
        except BaseException:
            if created:  # no model, no results: leave no empty file behind
                Path(config.output).unlink(missing_ok=True)
            raise
        if sink is not sys.stdout.buffer and stat.S_ISREG(os.fstat(sink.fileno()).st_mode):
            sink.truncate(0)  # the old results go only now that the run can start (a device
            # or a pipe, /dev/null among them, has none and cannot be truncated)
        try:
            if source_path is not None and source_path.is_file():  # not a FIFO: read once
                _count_in_background(source_path, progress)
            reader = LineReader(
                source,
                name=source_name,
                max_line_bytes=max_line_bytes(server_config.max_body_bytes),
            )
            runner = BatchRunner(
                BatchEndpoints(ServerResources.build(engine, server_config)),
                LineParser(server_config.max_body_bytes),
                max_pending_lines=config.max_pending_lines,
            )
            tally.begin()
            with progress:
                await runner.run(reader, sink, sink_name=sink_name, tally=tally, progress=progress)
        finally:
            await engine.stop()


async def _start_engine(
    config: ServerConfig, max_pending_lines: int, model: Model | None
) -> AsyncEngine:
    """The server's engine, set up as ``create_app``'s lifespan sets it up, except that its
    queue takes the whole window (the runner, not the queue, bounds what waits)."""
    model_thread = ModelThread()  # loads the model on the thread that will step it
    try:
        if model is None:
            model = await model_thread.run(load_model, config)
    except BaseException as exc:
        model_thread.shutdown()
        if not isinstance(exc, Exception):
            raise  # Ctrl-C while loading
        logger.debug("loading the model failed", exc_info=True)
        reason = " ".join(str(exc).split()) or type(exc).__name__  # one line
        raise BatchFailed(f"cannot load the model {config.model!r}: {reason}") from None
    engine = AsyncEngine(
        model,
        policy=make_policy(config.scheduling),
        max_num_batched_tokens=config.max_num_batched_tokens,
        limits=AdmissionLimits(
            max_queue=max_pending_lines,
            max_queued_tokens=max_pending_lines * model.capabilities.context_length,
        ),
        prefix_caching=config.prefix_caching,
        speculation=NgramSpeculation(config.speculative_ngram),
        model_thread=model_thread,
        chat_template=template_override(config.chat_template),
    )
    await engine.start()
    return engine


def _open_input(spec: str, files: ExitStack) -> tuple[BinaryIO, str, Path | None]:
    """The input stream, its name for messages, and its path when it is a file."""
    if spec == STDIO:
        return sys.stdin.buffer, "standard input", None
    path = Path(spec)
    try:
        stream = files.enter_context(path.open("rb"))
    except OSError as exc:
        raise BatchFailed(f"cannot read {spec}: {exc.strerror or exc}") from None
    return stream, spec, path


def _open_output(
    spec: str, source_path: Path | None, files: ExitStack
) -> tuple[BinaryIO, str, bool]:
    """The output stream, its name for messages, and whether it was created here. A file
    is opened for appending, so that it is checked before the model loads without losing
    what it holds; the run truncates it once the model is loaded."""
    if spec == STDIO:
        return sys.stdout.buffer, "standard output", False
    path = Path(spec)
    existed = path.exists()
    if source_path is not None and existed and _same_file(path, source_path):
        raise BatchFailed(f"the output {spec} is the input file; it would be overwritten")
    try:
        sink = path.open("ab")
    except OSError as exc:
        raise BatchFailed(f"cannot write {spec}: {exc.strerror or exc}") from None
    files.callback(_close_after_failure_reported, sink)
    return sink, spec, not existed


def _close_after_failure_reported(sink: BinaryIO) -> None:
    """Closes ``sink``; a write that failed (``/dev/full``) was reported already as the run's
    ``BatchFailed`` (the last flush is inside the run), and closing retries it: not again."""
    try:
        sink.close()
    except OSError:
        pass


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _count_in_background(path: Path, progress: BatchProgress) -> None:
    """Counts the file's requests on a daemon thread and gives the bar its total; the run
    never waits for it (a file that cannot be read is the reader's to report)."""
    loop = asyncio.get_running_loop()

    def count() -> None:
        try:
            total = count_requests(path)
            loop.call_soon_threadsafe(progress.set_total, total)
        except (OSError, RuntimeError):  # unreadable, or the run (and its loop) already ended
            pass

    threading.Thread(target=count, name="batch-count", daemon=True).start()
