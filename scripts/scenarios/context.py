"""What every scenario of ``bench.py`` runs with: the plan, where logs go, how to say progress,
and the servers and loads the scenarios share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from harness.server import Server, ServerSpec
from loadgen import LoadConfig, Transport, WorkloadConfig
from rich.console import Console

from scenarios.plan import Plan

REQUEST_TIMEOUT_S = 300.0
SMOLLM2_READY_S = 300.0


@dataclass(slots=True)
class Context:
    plan: Plan
    log_dir: Path
    console: Console

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}")

    def command(self, scenario: int) -> str:
        quick = " --quick" if self.plan.quick else ""
        smol = " --smollm2" if self.plan.quick and self.plan.smollm2 else ""
        return (
            f"python scripts/bench.py --scenarios {scenario} --repeats {self.plan.repeats}"
            f"{quick}{smol}"
        )


def mock_flags(slots: int, step_ms: float, *extra: str) -> tuple[str, ...]:
    return (
        "--model",
        "mock",
        "--mock-step-ms",
        f"{step_ms:g}",
        "--max-num-seqs",
        str(slots),
        *extra,
    )


def smollm2_spec(name: str, slots: int, *extra: str) -> ServerSpec:
    flags = ("--model", "smollm2", "--max-num-seqs", str(slots), "--max-model-len", "512", *extra)
    return ServerSpec.app(name, *flags, ready_timeout_s=SMOLLM2_READY_S)


async def warm_up(server: Server) -> None:
    """One short request, so that first-call costs (torch kernels, caches) stay out of runs."""
    async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S) as http:
        body = {"prompt": "warm up", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        response = await http.post(server.url + "/generate", json=body)
        response.raise_for_status()


def greedy_load(
    url: str,
    *,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    seed: int,
    duration_s: float | None = None,
    num_requests: int | None = None,
    **workload: object,
) -> LoadConfig:
    """A closed loop of greedy streams that each generate exactly their ``max_tokens``
    (ignore_eos), read over aiohttp (on two cores shared with the server, httpx's reading
    of 512 streams took a whole core and bounded scenario 1); ``workload`` sets the other
    ``WorkloadConfig`` fields."""
    return LoadConfig(
        url=url,
        transport=Transport.AIOHTTP,  # a lean client: ~2/3 of httpx's CPU a streamed token
        concurrency=concurrency,
        duration_s=duration_s,
        num_requests=num_requests,
        timeout_s=REQUEST_TIMEOUT_S,
        workload=WorkloadConfig(
            prompt_len=prompt_len,
            output_len=output_len,
            ignore_eos=True,
            temperature=0.0,
            seed=seed,
            **workload,  # type: ignore[arg-type]
        ),
    )
