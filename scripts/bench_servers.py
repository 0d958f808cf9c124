"""What `bench.py` measures with: server subprocesses, /metrics snapshots, and load runs marked
with server-side snapshots at chosen instants.

Servers are started with `server_process` (``launched``). `measure` runs one load against one and
takes a `Mark` (metrics, server and client CPU seconds) before the load, at each requested instant
of the run clock (so a steady-state window can skip the ramp-up and the drain), and after it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import httpx
from loadgen import LoadConfig, LoadResult, Outcome, RequestRecord, run_load
from prometheus_client.parser import text_string_to_metric_families
from server_process import ROOT, SCRIPTS, Server, ServerSpec, launched, runqueue_wait_s  # noqa: F401

# --------------------------------------------------------------------------- /metrics


@dataclass(frozen=True, slots=True)
class HistogramDelta:
    """A Prometheus histogram's observations between two scrapes."""

    bounds: tuple[float, ...]  # upper bounds, ascending, the last +Inf
    cumulative: tuple[float, ...]  # observations <= each bound
    total: float  # sum of the observed values

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Bucket-derived quantile as Prometheus' ``histogram_quantile`` computes it: linear
        inside the bucket that holds rank ``q * count``, from 0 for the first bucket; the largest
        finite bound when it falls in the +Inf bucket."""
        if not self.count:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, count in zip(self.bounds, self.cumulative, strict=True):
            if count >= rank:
                if math.isinf(bound):
                    return lower
                if count == below:
                    return bound
                return lower + (bound - lower) * (rank - below) / (count - below)
            lower, below = bound, count
        return lower

    def bucket_counts(self) -> list[tuple[float, float]]:
        """(upper bound, observations in that bucket alone), +Inf included."""
        counts, below = [], 0.0
        for bound, count in zip(self.bounds, self.cumulative, strict=True):
            counts.append((bound, count - below))
            below = count
        return counts


@dataclass(frozen=True, slots=True)
class Metrics:
    """One scrape of /metrics: every sample by (name, sorted labels)."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return cls(samples)

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def histogram(self, name: str) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        buckets = sorted(
            (float(dict(labels)["le"]), value)
            for (sample, labels), value in self.samples.items()
            if sample == name + "_bucket"
        )
        return (
            tuple(bound for bound, _ in buckets),
            tuple(count for _, count in buckets),
            self.value(name + "_sum"),
        )


def counter_delta(before: Metrics, after: Metrics, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def histogram_delta(before: Metrics, after: Metrics, name: str) -> HistogramDelta:
    bounds, cumulative_after, sum_after = after.histogram(name)
    _, cumulative_before, sum_before = before.histogram(name)
    if len(cumulative_before) != len(cumulative_after):
        cumulative_before = (0.0,) * len(cumulative_after)
    cumulative = tuple(a - b for a, b in zip(cumulative_after, cumulative_before, strict=True))
    return HistogramDelta(bounds, cumulative, sum_after - sum_before)


# --------------------------------------------------------------------------- measured runs


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
    server_cpu, client_cpu = server.cpu_seconds(), time.process_time()
    server_wait, client_wait = server.wait_seconds(), runqueue_wait_s("self")
    metrics = None
    if server.spec.has_metrics:
        response = await http.get(server.url + "/metrics")
        response.raise_for_status()
        metrics = Metrics.parse(response.text)
    at_s = 0.0 if origin is None else (sent + time.perf_counter()) / 2 - origin
    return Mark(at_s, metrics, server_cpu, client_cpu, server_wait, client_wait)
