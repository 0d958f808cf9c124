"""The batch runner against the HTTP server on the same requests (``scripts/bench_batch.py``).

One set of requests (alternately ``/v1/completions`` and ``/v1/chat/completions``, greedy,
``ignore_eos`` so that both sides generate exactly the same number of tokens) is run two ways,
interleaved round by round (A B, then B A) so that a change in the shared machine's load hits
both:

- **batch**: ``python -m app batch -i FILE -o OUT`` in a subprocess; its wall time is the one
  its summary reports (from the engine's start to the last line written: the model load is left
  out, as the server's is).
- **http**: the same bodies POSTed to ``python -m app serve`` with the same model flags, started
  for this side alone once ready, ``concurrency`` at a time over aiohttp (loadgen's lean
  client: on two shared cores httpx would measure itself); wall time from the first request
  sent to the last answer read.

The figure is the ratio of completion tokens per second, batch over http, per round. The HTTP
client runs on the same machine as the server (as the batch runner's reading and writing do).
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from harness.server import ROOT, ServerSpec, running
from rich.console import Console
from rich.table import Table

SUMMARY_RUN = re.compile(r"^batch: (\d+) requests in ([\d.]+) s: (\d+) ok", re.MULTILINE)
SUMMARY_TOKENS = re.compile(r"^batch: (\d+) prompt \+ (\d+) completion tokens", re.MULTILINE)
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class BatchBench:
    """One comparison.

    Attributes:
        name: names it in the table.
        model_flags: the model and engine flags both sides get (``--model mock ...``).
        requests / max_tokens: how many requests, each generating exactly this many tokens.
        http_concurrency: the HTTP client's requests in flight (>= the slots keeps them busy).
        rounds: interleaved rounds.
    """

    name: str
    model_flags: tuple[str, ...]
    requests: int
    max_tokens: int
    http_concurrency: int
    rounds: int = 3


@dataclass(frozen=True, slots=True)
class Timed:
    """One side's run: answers 200, completion tokens, wall seconds."""

    ok: int
    completion_tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s


@dataclass(frozen=True, slots=True)
class Round:
    batch: Timed
    http: Timed

    @property
    def ratio(self) -> float:
        """Batch tok/s over HTTP tok/s."""
        return self.batch.tokens_per_s / self.http.tokens_per_s


def requests_of(bench: BatchBench) -> list[tuple[str, dict[str, object]]]:
    """The (url, body) pairs both sides send."""
    pairs: list[tuple[str, dict[str, object]]] = []
    for i in range(bench.requests):
        common = {"max_tokens": bench.max_tokens, "temperature": 0, "ignore_eos": True}
        if i % 2:
            pairs.append((COMPLETIONS, {"prompt": f"Request {i}: tell me a story.", **common}))
        else:
            messages = [{"role": "user", "content": f"Request {i}: what is a batch?"}]
            pairs.append((CHAT, {"messages": messages, **common}))
    return pairs


def run_batch_side(bench: BatchBench, workdir: Path) -> Timed:
    """The batch subprocess over the requests; its own summary gives the figures."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", bench.name)
    source, output = workdir / f"{slug}.jsonl", workdir / f"{slug}.out.jsonl"
    with source.open("w") as file:
        for i, (url, body) in enumerate(requests_of(bench)):
            line = {"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}
            file.write(json.dumps(line) + "\n")
    argv = [sys.executable, "-m", "app", "batch", "-i", str(source), "-o", str(output)]
    done = subprocess.run(
        [*argv, "--no-progress", *bench.model_flags], cwd=ROOT, capture_output=True, text=True
    )
    run, tokens = SUMMARY_RUN.search(done.stderr), SUMMARY_TOKENS.search(done.stderr)
    if done.returncode != 0 or run is None or tokens is None:
        raise RuntimeError(f"batch failed ({done.returncode}): {done.stderr[-2000:]}")
    return Timed(ok=int(run[3]), completion_tokens=int(tokens[2]), wall_s=float(run[2]))


async def run_http_side(bench: BatchBench, url: str) -> Timed:
    """The same bodies POSTed to the server ``bench.http_concurrency`` at a time."""
    pairs = requests_of(bench)
    gate = asyncio.Semaphore(bench.http_concurrency)
    results: list[tuple[int, int]] = []  # (status, completion tokens)
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=bench.http_concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def send(path: str, body: dict[str, object]) -> None:
            async with gate, session.post(url + path, json=body) as response:
                answer = await response.json()
                tokens = answer["usage"]["completion_tokens"] if response.status == 200 else 0
                results.append((response.status, tokens))

        started = time.perf_counter()
        await asyncio.gather(*(send(path, body) for path, body in pairs))
        wall_s = time.perf_counter() - started
    ok = sum(1 for status, _ in results if status == 200)
    return Timed(ok=ok, completion_tokens=sum(tokens for _, tokens in results), wall_s=wall_s)


def compare(bench: BatchBench, workdir: Path) -> list[Round]:
    """``bench.rounds`` interleaved rounds. Each side starts cold in each round: the batch
    subprocess loads its model, and the server is started for its side alone (and stopped
    after), so neither runs on warm caches the other lacks, or beside the other's process."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", bench.name)
    spec = ServerSpec.app(f"batch-bench-{slug}", *bench.model_flags, ready_timeout_s=300)

    def http_side() -> Timed:
        with running(spec, workdir) as server:
            return asyncio.run(run_http_side(bench, server.url))

    rounds: list[Round] = []
    for index in range(bench.rounds):
        if index % 2 == 0:
            batch = run_batch_side(bench, workdir)
            http = http_side()
        else:
            http = http_side()
            batch = run_batch_side(bench, workdir)
        expected = bench.requests * bench.max_tokens
        for side in (batch, http):
            if side.ok != bench.requests or side.completion_tokens != expected:
                raise RuntimeError(f"{bench.name}: not every request answered: {side}")
        rounds.append(Round(batch=batch, http=http))
    return rounds


def report(results: Sequence[tuple[BatchBench, list[Round]]], console: Console) -> None:
    table = Table(title="batch runner vs HTTP server, same requests (completion tok/s)")
    for column in ("workload", "requests x tokens", "round", "batch", "http", "batch / http"):
        table.add_column(column, justify="right" if column != "workload" else "left")
    for bench, rounds in results:
        for index, round_ in enumerate(rounds):
            table.add_row(
                bench.name,
                f"{bench.requests} x {bench.max_tokens}",
                str(index + 1),
                f"{round_.batch.tokens_per_s:.0f}",
                f"{round_.http.tokens_per_s:.0f}",
                f"{round_.ratio:.2f}",
            )
        median = statistics.median(round_.ratio for round_ in rounds)
        table.add_row(bench.name, "", "median", "", "", f"{median:.2f}", style="bold")
    console.print(table)


def as_json(results: Sequence[tuple[BatchBench, list[Round]]]) -> dict[str, object]:
    return {
        bench.name: {
            "model_flags": list(bench.model_flags),
            "requests": bench.requests,
            "max_tokens": bench.max_tokens,
            "http_concurrency": bench.http_concurrency,
            "rounds": [
                {
                    "batch_tok_s": round_.batch.tokens_per_s,
                    "http_tok_s": round_.http.tokens_per_s,
                    "ratio": round_.ratio,
                }
                for round_ in rounds
            ],
            "median_ratio": statistics.median(round_.ratio for round_ in rounds),
        }
        for bench, rounds in results
    }
