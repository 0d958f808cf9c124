"""The paged KV cache's evidence (issue #17): multi-turn TTFT, a shared system prompt, 64 slots
in a 400 MiB pool, decode tok/s against a baseline checkout. The command line, and what each
workload measures, is ``scripts/bench_prefix_cache.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import httpx
from harness.metrics import histogram_delta, scrape
from harness.server import Server, ServerSpec, launched
from rich.console import Console

MIB = 2**20
WORKLOADS = ("multi-turn", "shared-prompt", "many-slots", "decode")
READY_S = 300.0
SYSTEM = (
    "You are the support assistant of a small hardware shop. Answer in plain words, name the "
    "part a customer needs, and say when something is out of stock. "
)
TOPICS = ("drills", "screws", "paint", "ladders", "hinges", "glue", "saws", "tape")


def _spec(name: str, flags: tuple[str, ...], baseline: Path | None = None) -> ServerSpec:
    spec = ServerSpec.app(name, *flags, ready_timeout_s=READY_S)
    if baseline is None:
        return spec
    # The other checkout's package first on sys.path, then its `python -m app`.
    runner = (
        f"import runpy, sys; sys.path.insert(0, {str(baseline)!r}); "
        "runpy.run_module('app', run_name='__main__', alter_sys=True)"
    )
    return ServerSpec(name, (sys.executable, "-c", runner, *spec.argv[3:]), ready_timeout_s=READY_S)


async def _generate(http: httpx.AsyncClient, server: Server, prompt: str, tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    response = await http.post(server.url + "/generate", json=body)
    response.raise_for_status()
    return response.json()


async def _counter(http: httpx.AsyncClient, server: Server, name: str) -> float:
    return (await scrape(http, server.url)).value(name)


async def multi_turn(
    model: tuple[str, ...], log_dir: Path, http: httpx.AsyncClient, rounds: int
) -> dict:
    """``rounds`` 5-turn conversations (each its own history after the shared system prompt),
    on and off interleaved turn by turn; the ratio is the median over conversations of turn
    5's TTFT on over off (one turn's TTFT is one step: a single sample swings with the
    machine)."""
    specs = [_spec("on", model), _spec("off", (*model, "--no-prefix-caching"))]
    ttft: dict[str, list[list[float]]] = {"on": [], "off": []}
    async with launched(specs, log_dir) as servers:
        for conversation in range(rounds):
            histories = {"on": SYSTEM * 4, "off": SYSTEM * 4}
            for side in ttft:
                ttft[side].append([])
            for turn in range(5):
                # interleaved turn by turn, the order flipping every turn
                for server in servers if turn % 2 == 0 else servers[::-1]:
                    side = server.spec.name
                    topic = TOPICS[(turn + 3 * conversation) % len(TOPICS)]
                    histories[side] += (
                        f"\nUser ({conversation}): tell me about {topic}, turn {turn}.\nShop:"
                    )
                    answer = await _generate(http, server, histories[side], 32)
                    ttft[side][-1].append(answer["timings"]["ttft_ms"])
                    histories[side] += answer["text"]
    ratios = [on[-1] / off[-1] for on, off in zip(ttft["on"], ttft["off"], strict=True)]
    return {
        "ttft_ms_on": ttft["on"],
        "ttft_ms_off": ttft["off"],
        "turn5_ratios": ratios,
        "turn5_ratio": statistics.median(ratios),
    }


async def shared_prompt(
    model: tuple[str, ...], log_dir: Path, http: httpx.AsyncClient, rounds: int
) -> dict:
    system = SYSTEM * 30  # ~1,000 tokens of SmolLM2's tokenizer
    specs = [_spec("on", model), _spec("off", (*model, "--no-prefix-caching"))]
    result: dict[str, dict[str, list[float]]] = {
        side: {"computed": [], "seconds": []} for side in ("on", "off")
    }
    async with launched(specs, log_dir) as servers:
        for round_index in range(rounds):
            for server in servers:
                side = server.spec.name
                queries = await _counter(http, server, "slotserve_prefix_cache_queries_total")
                hits = await _counter(http, server, "slotserve_prefix_cache_hits_total")
                prompts = [
                    f"{system}\nUser ({round_index}.{i}): which {TOPICS[i % 8]} do you sell?\n"
                    for i in range(16)
                ]
                started = time.perf_counter()
                answers = await asyncio.gather(*(_generate(http, server, p, 16) for p in prompts))
                result[side]["seconds"].append(time.perf_counter() - started)
                prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
                queried = await _counter(http, server, "slotserve_prefix_cache_queries_total")
                hit = await _counter(http, server, "slotserve_prefix_cache_hits_total")
                if side == "off":  # nothing is looked up: every prompt token is computed
                    result[side]["computed"].append(prompt_tokens)
                else:
                    assert queried - queries == prompt_tokens
                    result[side]["computed"].append(prompt_tokens - (hit - hits))
    on, off = result["on"], result["off"]
    return {
        **{f"{side}_{key}": values for side in result for key, values in result[side].items()},
        "computed_ratio": statistics.median(on["computed"]) / statistics.median(off["computed"]),
        "time_ratio": statistics.median(on["seconds"]) / statistics.median(off["seconds"]),
    }


async def many_slots(model: tuple[str, ...], log_dir: Path, http: httpx.AsyncClient) -> dict:
    flags = (*model, "--max-num-seqs", "64", "--max-model-len", "2048")
    flags += ("--kv-cache-memory", "400MiB", "--max-num-batched-tokens", "512")
    async with launched([_spec("64-slots", flags)], log_dir) as (server,):
        idle = server.stats.rss_bytes()
        # Distinct from their first token on: no two share a block, so the pool, not the
        # prefix cache, has to hold them (64 x ~44 blocks is more than 400 MiB holds).
        prompts = [
            f"Customer {i} asks about {TOPICS[i % 8]} number {i * 7919 % 1000}.\n{SYSTEM * 20}"
            for i in range(64)
        ]
        started = time.perf_counter()
        answers = await asyncio.gather(*(_generate(http, server, p, 32) for p in prompts))
        seconds = time.perf_counter() - started
        peak = server.stats.peak_rss_bytes()
        preemptions = await _counter(http, server, "slotserve_preemptions_total")
    completed = sum(a["finish_reason"] == "length" for a in answers)
    return {
        "completed": completed,
        "of": len(prompts),
        "prompt_tokens_mean": statistics.mean(a["usage"]["prompt_tokens"] for a in answers),
        "seconds": seconds,
        "rss_idle_mib": idle / MIB,
        "rss_peak_mib": peak / MIB,
        "rss_growth_mib": (peak - idle) / MIB,
        "pool_mib": 400.0,
        "preemptions": preemptions,
    }


async def decode(
    model: tuple[str, ...], log_dir: Path, http: httpx.AsyncClient, baseline: Path, rounds: int
) -> dict:
    """Aggregate decode tok/s, this checkout over ``baseline``, and where the time went: the
    servers' own model-step seconds (``slotserve_model_step_seconds``) per generated token, so
    a difference can be placed in the forward or above it (scheduler, sampling, HTTP).

    The two servers take turns within each round and the order flips every round (A B, B A,
    ...): a server that always went first would always meet what the previous wave left
    behind (the other server's freed memory, a neighbour's burst)."""
    flags = (*model, "--max-num-seqs", "64")
    specs = [_spec("paged", flags), _spec("baseline", flags, baseline)]
    names = [spec.name for spec in specs]
    rates: dict[str, dict[int, list[float]]] = {name: {1: [], 16: [], 64: []} for name in names}
    step_ms: dict[str, dict[int, list[float]]] = {name: {1: [], 16: [], 64: []} for name in names}
    async with launched(specs, log_dir) as servers:
        for round_index in range(rounds):
            for streams in (1, 16, 64):
                order = servers if round_index % 2 == 0 else servers[::-1]
                for server in order:
                    prompts = [f"Story {i} about {TOPICS[i % 8]}:" for i in range(streams)]
                    before = await scrape(http, server.url)
                    started = time.perf_counter()
                    answers = await asyncio.gather(
                        *(_generate(http, server, p, 64) for p in prompts)
                    )
                    seconds = time.perf_counter() - started
                    after = await scrape(http, server.url)
                    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
                    stepping = histogram_delta(before, after, "slotserve_model_step_seconds")
                    rates[server.spec.name][streams].append(tokens / seconds)
                    step_ms[server.spec.name][streams].append(stepping.total / tokens * 1000)

    def ratio(table: dict[str, dict[int, list[float]]], streams: int) -> float:
        return statistics.median(table["paged"][streams]) / statistics.median(
            table["baseline"][streams]
        )

    return (
        {f"{streams}_streams_ratio": ratio(rates, streams) for streams in (1, 16, 64)}
        | {f"{streams}_streams_step_ms_ratio": ratio(step_ms, streams) for streams in (1, 16, 64)}
        | {"tok_s": rates, "model_step_ms_per_token": step_ms}
    )


async def run(args: Namespace, console: Console) -> dict:
    """Every workload of ``args.only`` (``decode`` only with ``args.baseline``), in order."""
    model = ("--model", args.model, "--dtype", args.dtype)
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as workdir:
        log_dir = Path(workdir)
        async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
            if "multi-turn" in args.only:
                results["multi_turn"] = await multi_turn(model, log_dir, http, args.rounds)
                console.print("multi-turn", results["multi_turn"])
            if "shared-prompt" in args.only:
                results["shared_prompt"] = await shared_prompt(model, log_dir, http, args.rounds)
                console.print("shared-prompt", results["shared_prompt"])
            if "many-slots" in args.only:
                results["many_slots"] = await many_slots(model, log_dir, http)
                console.print("many-slots", results["many_slots"])
            if "decode" in args.only and args.baseline is not None:
                results["decode"] = await decode(model, log_dir, http, args.baseline, args.rounds)
                console.print("decode", results["decode"])
    return results
