"""A load run marked with the server's state at chosen instants: metrics, server and client CPU,
and both sides' CPU starvation, so a benchmark can measure a steady window that skips the
ramp-up and the drain.

    run = await measure(server, config, instants=(1.5, 8.0))
    window = run.window()           # between the two instants
    window.counter("slotserve_generated_tokens_total") / window.seconds
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import httpx
from loadgen import LoadConfig, LoadResult, Outcome, RequestRecord, run_load

from harness.metrics import HistogramDelta, Metrics, counter_delta, histogram_delta, scrape
from harness.process_stats import ProcessStats
from harness.server import Server


@dataclass(frozen=True, slots=True)
class Mark:
    """The server's state at one instant of a run (seconds on the run clock)."""

    at_s: float
    metrics: Metrics | None
    server_cpu_s: float
    client_cpu_s: float
    server_wait_s: float  # runnable, waiting for a CPU
    client_wait_s: float


@dataclass(frozen=True, slots=True)
class Window:
    """What happened between two marks, on both sides."""

    start: Mark
    end: Mark

    @property
    def seconds(self) -> float:
        return self.end.at_s - self.start.at_s

    def counter(self, name: str, **labels: str) -> float:
        return counter_delta(self._before, self._after, name, **labels)

    def histogram(self, name: str) -> HistogramDelta:
        return histogram_delta(self._before, self._after, name)

    def cpu_percent(self) -> tuple[float, float]:
        """(server, client) CPU use over the window, in % of one core."""
        server = self.end.server_cpu_s - self.start.server_cpu_s
        client = self.end.client_cpu_s - self.start.client_cpu_s
        return 100.0 * server / self.seconds, 100.0 * client / self.seconds

    def wait_percent(self) -> tuple[float, float]:
        """(server, client) time runnable but waiting for a CPU, in % of the window (summed
        over threads): how much the other load on the machine held them back."""
        server = self.end.server_wait_s - self.start.server_wait_s
        client = self.end.client_wait_s - self.start.client_wait_s
        return 100.0 * server / self.seconds, 100.0 * client / self.seconds

    def tokens_received(self, records: Iterable[RequestRecord]) -> int:
        """Output tokens of the given records whose chunks arrived inside the window."""
        lo, hi = self.start.at_s, self.end.at_s
        return sum(c.tokens for r in records for c in r.chunks if lo <= c.at < hi)

    def events_received(self, records: Iterable[RequestRecord]) -> int:
        lo, hi = self.start.at_s, self.end.at_s
        return sum(1 for r in records for c in r.chunks if lo <= c.at < hi)

    @property
    def _before(self) -> Metrics:
        if self.start.metrics is None:
            raise ValueError("this server has no /metrics")
        return self.start.metrics

    @property
    def _after(self) -> Metrics:
        if self.end.metrics is None:
            raise ValueError("this server has no /metrics")
        return self.end.metrics


@dataclass(frozen=True, slots=True)
class Run:
    """One load run: the client's result and marks before, at each instant asked, and after."""

    result: LoadResult
    marks: tuple[Mark, ...]

    def whole(self) -> Window:
        return Window(self.marks[0], self.marks[-1])

    def window(self, index: int = 1) -> Window:
        """Between the ``index``-th and the next mark (1: the first two instants asked)."""
        return Window(self.marks[index], self.marks[index + 1])

    def records(self, *outcomes: Outcome) -> list[RequestRecord]:
        return [r for r in self.result.records if not outcomes or r.outcome in outcomes]

    def failures(self) -> int:
        """Requests that ended neither ok nor cancelled (by this client)."""
        return sum(r.outcome not in (Outcome.OK, Outcome.CANCELLED) for r in self.result.records)


async def measure(server: Server, config: LoadConfig, instants: Sequence[float] = ()) -> Run:
    """Runs ``config`` against ``server`` and marks the server's state at ``instants`` (seconds
    from the run's start, ascending), as well as before and after the run.

    The run clock starts when the load task is created, within a millisecond of loadgen's own
    clock; a mark's time is the middle of its scrape.
    """
    async with httpx.AsyncClient(trust_env=False, timeout=30.0) as http:
        before = await take_mark(http, server, origin=None)
        origin = time.perf_counter()
        load = asyncio.create_task(run_load(config))
        marks = [before]
        for instant in instants:
            await asyncio.sleep(max(0.0, origin + instant - time.perf_counter()))
            if load.done():
                break
            marks.append(await take_mark(http, server, origin))
        result = await load
        marks.append(await take_mark(http, server, origin))
    return Run(result, tuple(marks))


async def take_mark(http: httpx.AsyncClient, server: Server, origin: float | None) -> Mark:
    sent = time.perf_counter()
    client = ProcessStats()
    server_cpu, client_cpu = server.stats.cpu_seconds(), time.process_time()
    server_wait, client_wait = server.stats.runqueue_wait_s(), client.runqueue_wait_s()
    metrics = await scrape(http, server.url) if server.spec.has_metrics else None
    at_s = 0.0 if origin is None else (sent + time.perf_counter()) / 2 - origin
    return Mark(at_s, metrics, server_cpu, client_cpu, server_wait, client_wait)
