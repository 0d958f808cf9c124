"""Soak test: many requests, a share cancelled or abandoned, bad bodies mixed in; then check
that nothing leaked.

    python scripts/soak.py                       # starts its own mock server, 10k requests
    python scripts/soak.py --num-requests 2000 --concurrency 32 --out soak.json
    python scripts/soak.py --url http://127.0.0.1:8000 --server-pid 1234

Every request is one of: a plain stream read to its end, a stream cancelled by DELETE after k
events, a stream whose client disconnects after k events, a non-stream request, or a bad body
(expects 422). At the end the script checks, and exits 1 if any check fails:

* /metrics: ``slotserve_requests_running`` and ``..._waiting`` are back to 0;
* every accepted request ended exactly once on the server (``requests_finished_total`` grew by
  the number of accepted requests) and every stream that was read to its end saw exactly one
  final event (``done`` or ``error``), with ``cancelled`` for those it DELETEd;
* no 5xx answers and no transport errors;
* the server's RSS grew by less than ``--max-rss-growth`` between the end of a warm-up and the
  end of the run (when the server's pid is known).

Traffic goes only to the given URL (loopback by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table
from server_process import ServerSpec, running

BAD_BODIES = (
    b'{"prompt": ""}',
    b'{"prompt": "x", "temperature": -1}',
    b'{"prompt": "x", "stop": [""]}',
    b'{"prompt": "x", "bogus": 1}',
    b'{"prompt": "x", "temperature": NaN}',
    b"{not json",
    b'{"prompt": "x", "max_tokens": "ten"}',
)


@dataclass(frozen=True, slots=True)
class SoakConfig:
    url: str
    num_requests: int
    concurrency: int
    cancel_fraction: float
    disconnect_fraction: float
    bad_fraction: float
    non_stream_fraction: float
    max_tokens: int
    seed: int
    max_rss_growth: float
    server_pid: int | None


@dataclass(slots=True)
class SoakTally:
    """Counts by outcome; ``problems`` lists every check that failed."""

    outcomes: Counter[str] = field(default_factory=Counter)
    accepted: int = 0
    problems: list[str] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="server to soak; default: start a mock server on 127.0.0.1")
    parser.add_argument("--server-pid", type=int, help="pid of --url's server, for RSS")
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cancel-fraction", type=float, default=0.15, help="DELETEd mid-stream")
    parser.add_argument("--disconnect-fraction", type=float, default=0.15, help="client leaves")
    parser.add_argument("--bad-fraction", type=float, default=0.05, help="invalid bodies")
    parser.add_argument("--non-stream-fraction", type=float, default=0.2)
    parser.add_argument(
        "--max-tokens", type=int, default=24, help="mean max_tokens (uniform 1..2x)"
    )
    parser.add_argument("--mock-step-ms", type=float, default=1.0, help="for the started server")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="for the started server")
    parser.add_argument("--max-rss-growth", type=float, default=0.10, help="fraction, e.g. 0.10")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    return parser.parse_args(argv)


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """Sums every /metrics sample by name (labels folded), e.g. finished_total over reasons."""
    totals: Counter[str] = Counter()
    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
            if sample.name == "slotserve_requests_finished_total":
                totals[f"finished:{sample.labels['finish_reason']}"] += sample.value
    return dict(totals)


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def one_request(
    client: httpx.AsyncClient, index: int, config: SoakConfig, rng: random.Random, tally: SoakTally
) -> None:
    roll = rng.random()
    max_tokens = rng.randint(1, 2 * config.max_tokens)
    body = {"prompt": f"soak {index} {rng.random():.6f}", "max_tokens": max_tokens}
    request_id = f"soak-{config.seed}-{index}"
    headers = {"X-Request-Id": request_id}
    edges = [config.bad_fraction]
    edges.append(edges[-1] + config.non_stream_fraction)
    edges.append(edges[-1] + config.cancel_fraction)
    edges.append(edges[-1] + config.disconnect_fraction)
    answered = False  # a status line came back: from here on a transport error is a real fault
    try:
        if roll < edges[0]:
            response = await client.post(
                "/generate", content=rng.choice(BAD_BODIES), headers=headers
            )
            outcome = (
                "bad_body_422"
                if response.status_code == 422
                else f"bad_body_{response.status_code}"
            )
            if response.status_code != 422:
                tally.problems.append(f"{request_id}: bad body answered {response.status_code}")
            tally.outcomes[outcome] += 1
            return
        if roll < edges[1]:
            response = await client.post("/generate", json=body, headers=headers)
            answered = True
            tally.outcomes[f"non_stream_{response.status_code}"] += 1
            if response.status_code == 200:
                tally.accepted += 1
            elif response.status_code >= 500:
                tally.problems.append(f"{request_id}: {response.status_code} {response.text[:200]}")
            return
        mode = "delete" if roll < edges[2] else "disconnect" if roll < edges[3] else "full"
        body.update(stream=True, ignore_eos=mode != "full")
        if mode != "full":
            body["max_tokens"] = max(max_tokens, 200)  # long enough to still be running
        cut_after = rng.randint(1, 5)
        async with client.stream("POST", "/generate", json=body, headers=headers) as response:
            answered = True
            if response.status_code != 200:
                await response.aread()
                tally.outcomes[f"stream_{response.status_code}"] += 1
                if response.status_code >= 500:
                    tally.problems.append(f"{request_id}: {response.status_code}")
                return
            tally.accepted += 1
            finals: list[str] = []
            tokens = 0
            deleted = False
            event = ""
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event:
                    if event == "token":
                        tokens += 1
                        if tokens == cut_after and mode == "disconnect":
                            tally.outcomes["stream_disconnected"] += 1
                            return  # leaving the `async with` closes the connection
                        if tokens == cut_after and mode == "delete":
                            deleted = (
                                await client.delete(f"/generate/{request_id}")
                            ).status_code == 200
                    else:
                        finals.append(json.loads(line[5:]).get("finish_reason", event))
                    event = ""
            if len(finals) != 1:
                tally.problems.append(f"{request_id}: {len(finals)} final events")
            elif deleted and finals[0] != "cancelled":
                tally.problems.append(f"{request_id}: DELETE answered 200 but ended {finals[0]}")
            name = {"delete": "stream_deleted", "disconnect": "stream_ended_before_cut"}.get(
                mode, "stream_full"
            )
            tally.outcomes[name if (mode != "delete" or deleted) else "stream_delete_too_late"] += 1
    except httpx.TransportError as exc:
        if answered:
            tally.outcomes["transport_error"] += 1
            tally.problems.append(f"{request_id}: transport error mid-answer {exc!r}")
        else:
            # The request never got an answer (e.g. a keep-alive connection the server closed as
            # it was reused): not a leak, and the server-side count below still has to match.
            tally.outcomes["transport_error_before_answer"] += 1


async def run_phase(config: SoakConfig, count: int, offset: int, tally: SoakTally) -> None:
    """``count`` requests over ``config.concurrency`` workers, each with its own connection
    (one shared httpx pool costs more client CPU than the server spends on the request)."""
    rng = random.Random(config.seed * 1_000_003 + offset)
    next_index = offset
    end = offset + count

    async def worker() -> None:
        nonlocal next_index
        async with httpx.AsyncClient(base_url=config.url, timeout=60) as client:
            while next_index < end:
                index = next_index
                next_index += 1
                await one_request(client, index, config, rng, tally)

    await asyncio.gather(*(worker() for _ in range(config.concurrency)))


async def soak(config: SoakConfig, console: Console) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=config.url, timeout=60) as client:
        warmup = min(500, max(config.num_requests // 10, 1))
        tally = SoakTally()
        await run_phase(config, warmup, 0, tally)
        await asyncio.sleep(0.5)
        rss_before = rss_bytes(config.server_pid)
        before = await scrape(client)
        tally = SoakTally()
        started = time.perf_counter()
        await run_phase(config, config.num_requests, warmup, tally)
        duration = time.perf_counter() - started
        after = await scrape(client)
        for _ in range(100):  # disconnected requests end at the next step; give it a moment
            if (
                after.get("slotserve_requests_running", 0) == 0
                and after.get("slotserve_requests_waiting", 0) == 0
            ):
                break
            await asyncio.sleep(0.05)
            after = await scrape(client)
        await asyncio.sleep(0.3)
        after = await scrape(client)
        rss_after = rss_bytes(config.server_pid)

    finished = after.get("slotserve_requests_finished_total", 0) - before.get(
        "slotserve_requests_finished_total", 0
    )
    if after.get("slotserve_requests_running", 0) != 0:
        tally.problems.append(f"running gauge is {after['slotserve_requests_running']}, not 0")
    if after.get("slotserve_requests_waiting", 0) != 0:
        tally.problems.append(f"waiting gauge is {after['slotserve_requests_waiting']}, not 0")
    if int(finished) != tally.accepted:
        tally.problems.append(
            f"server finished {int(finished)} requests, {tally.accepted} were accepted"
        )
    growth = None
    if rss_before and rss_after:
        growth = (rss_after - rss_before) / rss_before
        if growth > config.max_rss_growth:
            tally.problems.append(f"RSS grew {growth:.1%} (limit {config.max_rss_growth:.0%})")
    by_reason = {
        k.split(":", 1)[1]: after.get(k, 0) - before.get(k, 0)
        for k in after
        if k.startswith("finished:")
    }
    return {
        "config": asdict(config),
        "duration_s": duration,
        "requests_per_s": config.num_requests / duration,
        "outcomes": dict(tally.outcomes),
        "accepted": tally.accepted,
        "server_finished": int(finished),
        "server_finished_by_reason": by_reason,
        "rss_before_bytes": rss_before,
        "rss_after_bytes": rss_after,
        "rss_growth": growth,
        "problems": tally.problems,
        "ok": not tally.problems,
    }


def print_report(result: dict[str, object], console: Console) -> None:
    table = Table(title="soak: outcomes")
    table.add_column("outcome")
    table.add_column("count", justify="right")
    for name, count in sorted(result["outcomes"].items()):  # type: ignore[union-attr]
        table.add_row(name, str(count))
    console.print(table)
    summary = Table(title="soak: checks", show_header=False)
    summary.add_row(
        "requests / duration",
        f"{result['config']['num_requests']} in {result['duration_s']:.1f} s "  # type: ignore[index]
        f"({result['requests_per_s']:.0f} req/s)",
    )
    summary.add_row(
        "accepted / finished on server", f"{result['accepted']} / {result['server_finished']}"
    )
    summary.add_row("server finish reasons", json.dumps(result["server_finished_by_reason"]))
    if result["rss_before_bytes"]:
        summary.add_row(
            "server RSS before / after",
            f"{result['rss_before_bytes'] / 2**20:.1f} MiB / "  # type: ignore[operator]
            f"{result['rss_after_bytes'] / 2**20:.1f} MiB "  # type: ignore[operator]
            f"({result['rss_growth']:+.1%})",
        )
    summary.add_row("problems", str(len(result["problems"])))  # type: ignore[arg-type]
    console.print(summary)
    for problem in result["problems"][:20]:  # type: ignore[index]
        console.print(f"[red]{problem}[/red]")
    console.print("[green]OK: nothing leaked[/green]" if result["ok"] else "[red]FAILED[/red]")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    with ExitStack() as stack:
        url, pid = args.url, args.server_pid
        if url is None:
            spec = ServerSpec.mock(
                "soak-mock", step_ms=args.mock_step_ms, max_num_seqs=args.max_num_seqs
            )
            server = stack.enter_context(running(spec, Path(tempfile.mkdtemp(prefix="soak-"))))
            url, pid = server.url, server.pid
        config = SoakConfig(
            url=url,
            num_requests=args.num_requests,
            concurrency=args.concurrency,
            cancel_fraction=args.cancel_fraction,
            disconnect_fraction=args.disconnect_fraction,
            bad_fraction=args.bad_fraction,
            non_stream_fraction=args.non_stream_fraction,
            max_tokens=args.max_tokens,
            seed=args.seed,
            max_rss_growth=args.max_rss_growth,
            server_pid=pid,
        )
        result = asyncio.run(soak(config, console))
    print_report(result, console)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
