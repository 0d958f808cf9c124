"""scripts/bench_routing.py: the hit-rate arithmetic on made-up counters, and one small run
through the cache-aware router with mock replicas (every process stopped at the end)."""

from __future__ import annotations

import json

import pytest
from bench_routing import main
from harness.metrics import Metrics
from harness.router import find_router
from scenarios.routing import RoutingBench, SharedPrefix, TurnRecord, summarize


def counters(hits: float, queries: float, served: float) -> Metrics:
    return Metrics.parse(
        f"vllm:prefix_cache_hits_total {hits}\nvllm:prefix_cache_queries_total {queries}\n"
        f"vllm:e2e_request_latency_seconds_count {served}\n"
    )


def test_history_hit_rate_leaves_out_the_shared_system_prompt() -> None:
    bench = RoutingBench(setups=("router",), server_args=(), conversations=2, turns=2)
    records = [TurnRecord(c, t, 0.01 * t, 0.5, 64) for c in range(2) for t in (1, 2)]
    before = [counters(0, 0, 0), counters(0, 0, 0)]
    # 4 requests of 600 prompt tokens each, the 500-token system prompt (496 in full blocks)
    # found by all, 64 more found by the two second turns.
    after = [counters(2 * 496 + 64, 1200, 2), counters(2 * 496 + 64, 1200, 2)]
    result = summarize("router", bench, records, 0, 2.0, before, after, SharedPrefix(500, 496))
    assert result.hit_rate == round((4 * 496 + 128) / 2400, 4)
    assert result.history_hit_rate == round(128 / (2400 - 4 * 500), 4)
    assert result.requests_per_replica == [2, 2]
    assert result.turn_ttft_p50_s == {1: 0.01, 2: 0.02}
    assert result.tokens_per_s == 4 * 64 / 2.0


@pytest.mark.slow
def test_a_small_run_through_the_router_writes_its_report(tmp_path) -> None:
    if find_router() is None:
        pytest.skip("vllm-router is not installed (pip install -e .[test])")
    out, plot = tmp_path / "routing.json", tmp_path / "routing.png"
    main(
        ["--setups", "router", "--replicas", "2", "--conversations", "3", "--turns", "2"]
        + ["--system-tokens", "64", "--answer-tokens", "4", "--think-s", "0"]
        + ["--mock-step-ms", "2", "--out", str(out), "--plot", str(plot)]
    )
    [setup] = json.loads(out.read_text())["setups"]
    assert setup["setup"] == "router" and setup["errors"] == 0
    assert sum(setup["requests_per_replica"]) == 6
    assert setup["prefix_queries"] > 0 and 0 < setup["hit_rate"] < 1
    assert set(setup["turn_ttft_p50_s"]) == {"1", "2"}
    assert plot.stat().st_size > 10_000
