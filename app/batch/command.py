"""``python -m app batch``'s process: logging beside the bar, the run, the summary, the exit code.

Exit codes: 0 once every line is written (lines that failed included: each carries its error),
2 when the run cannot start or go on (the input cannot be read, the output cannot be written,
the model cannot be loaded: one line on standard error, no traceback), 130 on Ctrl-C (the lines
written so far stay, in order).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from rich.console import Console
from rich.logging import RichHandler

from app.batch.config import STDIO, BatchConfig
from app.batch.progress import BatchProgress, BatchTally
from app.batch.runner import BatchFailed, run_batch

PROG = "python -m app batch"
EXIT_FAILED = 2
EXIT_INTERRUPTED = 130


def main(config: BatchConfig) -> int:
    """Runs the batch ``config`` describes; returns the exit code (see the module doc)."""
    console = Console(stderr=True)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(name)s: %(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
        force=True,
    )
    tally = BatchTally()
    # Lines on a terminal are their own progress: a bar would be drawn through them.
    show_bar = config.progress and not (config.output == STDIO and sys.stdout.isatty())
    progress = BatchProgress(console, tally, enabled=show_bar)
    try:
        asyncio.run(run_batch(config, tally, progress))
    except BatchFailed as failed:
        console.print(f"{PROG}: error: {failed}", highlight=False, markup=False, soft_wrap=True)
        return EXIT_FAILED
    except KeyboardInterrupt:
        message = f"{PROG}: interrupted; {tally.lines} lines written, in input order"
        console.print(message, highlight=False, markup=False, soft_wrap=True)
        return EXIT_INTERRUPTED
    finally:
        if config.output == STDIO:
            _flush_stdout()
    progress.print_summary()
    return 0


def _flush_stdout() -> None:
    """Standard output flushed now; a reader that went away (a closed pipe) is not an error
    Python reports again at exit."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
