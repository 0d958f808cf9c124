"""What a batch run tells its user on standard error: a rich progress bar while it runs
(lines done of the total when the input is a file, completion tokens per second), then a
summary (lines ok and failed, why they failed, tokens, wall time, tokens per second)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from app.batch.results import Answered, LineResult


@dataclass(slots=True)
class BatchTally:
    """What the lines written so far add up to (owned by the runner's writer).

    Attributes:
        ok: lines answered 200. failed_by_cause: the other lines, by HTTP status or line error
            code. prompt_tokens / completion_tokens: usage of the lines answered 200.
        started_at: ``time.perf_counter()`` seconds when the run began (``begin``: once the
            model is loaded, so that the rates are the engine's, not the loading's).
    """

    started_at: float = field(default_factory=time.perf_counter)
    ok: int = 0
    failed_by_cause: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def failed(self) -> int:
        return sum(self.failed_by_cause.values())

    @property
    def lines(self) -> int:
        return self.ok + self.failed

    def begin(self) -> None:
        self.started_at = time.perf_counter()

    def wall_s(self) -> float:
        return time.perf_counter() - self.started_at

    def count(self, result: LineResult) -> None:
        if isinstance(result, Answered) and result.answer.ok:
            self.ok += 1
            self.prompt_tokens += result.answer.prompt_tokens
            self.completion_tokens += result.answer.completion_tokens
        elif isinstance(result, Answered):
            self.failed_by_cause[str(result.answer.status_code)] += 1
        else:
            self.failed_by_cause[result.code] += 1

    def summary(self) -> list[str]:
        """The closing lines: ``lines: ok, failed (causes)`` and the token throughput."""
        wall_s = max(self.wall_s(), 1e-9)
        causes = ", ".join(f"{cause}: {n}" for cause, n in sorted(self.failed_by_cause.items()))
        failed = f"{self.failed} failed" + (f" ({causes})" if causes else "")
        return [
            f"batch: {self.lines} requests in {wall_s:.2f} s: {self.ok} ok, {failed}",
            f"batch: {self.prompt_tokens} prompt + {self.completion_tokens} completion tokens, "
            f"{self.completion_tokens / wall_s:.1f} completion tok/s, "
            f"{self.lines / wall_s:.1f} requests/s",
        ]


class BatchProgress:
    """The progress bar (on ``console``, normally standard error); ``enabled`` False shows
    nothing until the summary.

    Args:
        console: where to draw.
        tally: the counts it shows.
        enabled: draw the bar.
    """

    def __init__(self, console: Console, tally: BatchTally, *, enabled: bool) -> None:
        self.console = console
        self._tally = tally
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._total: int | None = None  # known once the input file is counted
        if enabled:
            self._progress = Progress(
                TextColumn("batch"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("requests"),
                TextColumn("{task.fields[tokens_per_s]:.0f} tok/s"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            )

    def __enter__(self) -> BatchProgress:
        """Shows the bar from now (its clock starts here: after the model is loaded)."""
        if self._progress is not None:
            self._task = self._progress.add_task("batch", total=self._total, tokens_per_s=0.0)
            self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def set_total(self, total: int) -> None:
        """The number of requests, once known (counted in the input file)."""
        self._total = total
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, total=total)

    def show(self) -> None:
        """Brings the bar up to the tally (after each line written)."""
        if self._progress is not None and self._task is not None:
            tokens_per_s = self._tally.completion_tokens / max(self._tally.wall_s(), 1e-9)
            self._progress.update(
                self._task, completed=self._tally.lines, tokens_per_s=tokens_per_s
            )

    def print_summary(self) -> None:
        for line in self._tally.summary():
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)


def count_requests(path: Path) -> int:
    """Non-blank lines of the file at ``path``: the total the bar counts to. Reads it once,
    a chunk at a time (for a file of millions of lines, on a worker thread).

    Raises:
        OSError: the file cannot be read.
    """
    count = 0
    with path.open("rb") as file:
        has_text = False  # the current line, read in parts of at most 1 MiB, has some
        while part := file.readline(1 << 20):
            has_text = has_text or bool(part.strip())
            if part.endswith(b"\n"):
                count += has_text
                has_text = False
    return count + has_text
