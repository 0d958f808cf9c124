"""Runs a load: closed loop (N in flight) or open loop (timed arrivals), bounded in requests
and/or time. `run_load` is the library entry point; the CLI, the benchmarks, the soak and the
overload burst call it: the one load loop of scripts/."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import httpx

from loadgen.client import AiohttpPlain, LoadClient, RunClock
from loadgen.config import LoadConfig, Transport
from loadgen.record import RequestRecord
from loadgen.stats import Slo, Summary, summarize
from loadgen.workload import RequestSpec, arrival_offsets, request_specs

OnRecord = Callable[[RequestRecord], None]


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A finished run: its config, what every request did (by index), and the summary."""

    config: LoadConfig
    started_at_unix: float  # wall clock at the run's start; record times are relative to it
    duration_s: float  # first send to last end
    records: tuple[RequestRecord, ...]
    summary: Summary


async def run_load(
    config: LoadConfig,
    on_record: OnRecord | None = None,
    *,
    specs: Iterable[RequestSpec] | None = None,
) -> LoadResult:
    """Run the load `config` describes; `on_record` is called as each request ends.

    `specs` replaces the requests of `config.workload` (a script's own mix of requests); the
    run still stops at `config.num_requests` or `config.duration_s`, or when they run out.
    """
    return await LoadRun(config, on_record, specs).execute()


class LoadRun:
    """One run's state: the requests still to send and the records of those that ended."""

    def __init__(
        self, config: LoadConfig, on_record: OnRecord | None, specs: Iterable[RequestSpec] | None
    ) -> None:
        self._config = config
        self._on_record = on_record
        if specs is None:
            specs = request_specs(
                config.workload, config.num_requests, run_tag=secrets.token_hex(4)
            )
        elif config.num_requests is not None:
            specs = (spec for spec, _ in zip(specs, range(config.num_requests), strict=False))
        self._specs: Iterator[RequestSpec] = iter(specs)
        self._records: list[RequestRecord] = []
        self._tls = httpx.create_ssl_context()
        self._clock = RunClock()  # the run starts now: `run_load` executes it at once

    async def execute(self) -> LoadResult:
        started_at_unix = time.time()
        if self._config.closed_loop:
            await self._closed_loop()
        else:
            async with self._client() as client:
                await self._open_loop(client)
        return self._result(started_at_unix)

    async def _closed_loop(self) -> None:
        """`concurrency` workers, each sending its next request as soon as the last one ends."""
        assert self._config.concurrency is not None
        async with asyncio.TaskGroup() as workers:
            for _ in range(self._config.concurrency):
                workers.create_task(self._worker())

    async def _worker(self) -> None:
        # A connection pool per worker: httpcore's pool does O(connections) work per request and
        # O(connections^2) once connections go idle, so one pool shared by N workers costs the
        # client more CPU than the server it measures (most of the client's time at N = 128).
        async with self._client() as client:
            while (spec := self._next_spec()) is not None:
                await self._send(client, spec)

    async def _open_loop(self, client: LoadClient) -> None:
        """Send each request at its arrival time, whatever is still in flight."""
        config = self._config
        assert config.rate is not None
        arrivals = arrival_offsets(config.rate, config.burstiness, config.workload.seed)
        async with asyncio.TaskGroup() as in_flight:
            for send_at in arrivals:
                if config.duration_s is not None and send_at >= config.duration_s:
                    break
                spec = self._next_spec()
                if spec is None:
                    break
                await asyncio.sleep(send_at - self._clock.now())
                in_flight.create_task(self._send(client, spec))

    def _next_spec(self) -> RequestSpec | None:
        """The next request, or None once the requests or the time are used up."""
        duration_s = self._config.duration_s
        if duration_s is not None and self._clock.now() >= duration_s:
            return None
        return next(self._specs, None)

    async def _send(self, client: LoadClient, spec: RequestSpec) -> None:
        record = await client.send(spec)
        self._records.append(record)
        if self._on_record is not None:
            self._on_record(record)

    @asynccontextmanager
    async def _client(self) -> AsyncIterator[LoadClient]:
        """A client with its own connections (httpx, and aiohttp when the run sends with it).

        No pool limit: a capped pool would queue requests inside the client (and starve the
        DELETEs) and so measure the client instead of the server. No proxies from the env.
        One TLS context for all clients: building one per client costs ~10 ms of CPU.
        """
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(self._config.timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            trust_env=False,
            verify=self._tls,
        ) as http:
            if self._config.transport is not Transport.AIOHTTP:
                yield LoadClient(http, self._config, self._clock)
                return
            connector = aiohttp.TCPConnector(limit=0, ssl=self._tls)
            # No session timeout (aiohttp's default is 300 s in all): ``--timeout`` bounds each
            # request (``LoadClient.send``), streams included.
            session = aiohttp.ClientSession(
                connector=connector, trust_env=False, timeout=aiohttp.ClientTimeout(total=None)
            )
            async with session:
                yield LoadClient(http, self._config, self._clock, AiohttpPlain(session))

    def _result(self, started_at_unix: float) -> LoadResult:
        records = tuple(sorted(self._records, key=lambda record: record.spec.index))
        duration_s = max((record.finished_at for record in records), default=0.0)
        slo = Slo(ttft_ms=self._config.slo_ttft_ms, tpot_ms=self._config.slo_tpot_ms)
        return LoadResult(
            config=self._config,
            started_at_unix=started_at_unix,
            duration_s=duration_s,
            records=records,
            summary=summarize(records, duration_s, slo),
        )
