"""scripts/bench_routing.py: the hit-rate arithmetic and its bound on made-up counters, the
medians and ratios over rounds, the mock's KV pool sized to a share of the chats, the long-turn
workload's turns and pool, and one small run through the cache-aware router with mock replicas
(every process stopped at the end)."""

from __future__ import annotations

import json

import pytest
from bench_routing import WORKLOADS, main, mock_context, mock_kv_bytes, server_args
from harness.metrics import Metrics
from harness.router import find_router
from scenarios.routing import (
    TURN_FRAME,
    RouterSettings,
    RoutingBench,
    SetupResult,
    SharedPrefix,
    TurnRecord,
    median_result,
    own_tokens,
    question,
    ratios,
    summarize,
)


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
    # The system prompt's blocks are this share of the prompt tokens: no routing finds less.
    assert result.shared_floor == round(4 * 496 / 2400, 4)


def made_up(setup: str, hit: float, own: float, turn_p50: float, tok_s: float) -> SetupResult:
    return SetupResult(
        setup=setup,
        hit_rate=hit,
        history_hit_rate=own,
        prefix_hits=hit * 1000,
        prefix_queries=1000,
        wall_s=10.0,
        completion_tokens=int(tok_s * 10),
        tokens_per_s=tok_s,
        ttft_p50_s=turn_p50,
        ttft_p95_s=2 * turn_p50,
        turn_ttft_p50_s={1: 0.1, 2: turn_p50},
        turn_ttft_p95_s={1: 0.2, 2: 2 * turn_p50},
        requests_per_replica=[10, 12, 8],
        shared_floor=0.6,
    )


def test_medians_and_ratios_over_rounds() -> None:
    rounds = [
        [made_up("router", 0.9, 0.6, 0.05, 500), made_up("nginx", 0.75, 0.3, 0.2, 500)],
        [made_up("router", 0.8, 0.5, 0.10, 510), made_up("nginx", 0.70, 0.2, 0.2, 500)],
        [made_up("router", 0.85, 0.7, 0.08, 490), made_up("nginx", 0.80, 0.35, 0.1, 490)],
    ]
    router = median_result([results[0] for results in rounds])
    assert (router.hit_rate, router.history_hit_rate, router.tokens_per_s) == (0.85, 0.6, 500)
    assert router.turn_ttft_p50_s == {1: 0.1, 2: 0.08}
    assert router.requests_per_replica == [12, 10, 8]  # busiest first
    found = ratios(rounds, "router", "nginx", turn=2)
    assert found.per_round["hit_rate"] == [1.2, round(0.8 / 0.7, 4), round(0.85 / 0.8, 4)]
    assert found.hit_rate == round(0.8 / 0.7, 4)
    assert found.history_hit_rate == 2.0  # of 2.0, 2.5 and 0.7 / 0.35
    assert found.turn_ttft_p50 == 0.5  # of 0.25, 0.5 and 0.8
    assert found.tokens_per_s == 1.0
    assert found.hit_rate_bound == round(1 / 0.6, 4)


def test_the_mock_pool_holds_a_share_of_the_chats() -> None:
    bench = RoutingBench(setups=("router",), server_args=())
    per_chat = own_tokens(bench)
    # 5 turns of 64-token answers, each with a question of 8 words in its frame.
    assert 5 * (64 + 40) < per_chat < 5 * (64 + 120)
    eight, all_of_them = mock_kv_bytes(bench, 8, 1), mock_kv_bytes(bench, 24, 1)
    system = -(-(500 + 96) // 16) * 16 * 4  # whole blocks, 4 bytes a position
    assert 8 * per_chat * 4 < eight - system <= 8 * (per_chat + 16) * 4
    assert all_of_them - system > 3 * (eight - system) - 64
    flags = server_args("mock", 20, 8, 64, f"{eight}B", mock_context(bench))
    assert flags[flags.index("--kv-cache-memory") + 1] == f"{eight}B"
    assert flags[flags.index("--mock-context-length") + 1] == "2048"
    # A workload too small for the server's least pool (one whole context) gets that least.
    small = RoutingBench(setups=("router",), server_args=(), conversations=3, system_tokens=64)
    assert mock_kv_bytes(small, 1, 1) == 2048 * 4
    assert "--kv-cache-memory" not in server_args("mock", 20, 8, 64, None)


def test_the_documents_workload_has_long_turns_and_a_pool_to_match() -> None:
    chat, documents = (
        RoutingBench(
            setups=("router",),
            server_args=(),
            question_words=WORKLOADS[name].question_words,
            answer_tokens=WORKLOADS[name].answer_tokens,
        )
        for name in ("chat", "documents")
    )
    turns = [
        len((TURN_FRAME + question(documents, c, t)).encode())
        for c in range(documents.conversations)
        for t in range(1, documents.turns + 1)
    ]
    assert 300 <= min(turns) and max(turns) <= 600  # a pasted passage, in bytes (mock tokens)
    assert documents.answer_tokens == 100
    # The system prompt's share of the prompt tokens, with ~590 of them: well under a third.
    system, prompts, history = 590, 0, 590
    for turn in turns[: documents.turns]:
        history += turn
        prompts += history
        history += documents.answer_tokens
    assert documents.turns * system / prompts < 0.3
    # The pool holds the same 8 chats, so it grows with them.
    grown = own_tokens(documents) / own_tokens(chat)
    system_bytes = -(-(500 + 96) // 16) * 16 * 4
    eight = [mock_kv_bytes(bench, 8, 1) - system_bytes for bench in (chat, documents)]
    assert eight[1] / eight[0] == pytest.approx(grown, rel=0.05)
    assert mock_context(documents) >= 590 + 5 * max(turns) + 5 * 100


def test_router_settings_become_its_flags() -> None:
    flags = RouterSettings(0.3, 4, 1.5).flags()
    assert flags == (
        "--cache-threshold",
        "0.3",
        "--balance-abs-threshold",
        "4",
        "--balance-rel-threshold",
        "1.5",
    )


@pytest.mark.slow
def test_a_small_run_through_the_router_writes_its_report(tmp_path) -> None:
    if find_router() is None:
        pytest.skip("vllm-router is not installed (pip install -e .[test])")
    out, plot = tmp_path / "routing.json", tmp_path / "routing.png"
    main(
        ["--setups", "router", "--replicas", "2", "--conversations", "3", "--turns", "2"]
        + ["--system-tokens", "64", "--answer-tokens", "4", "--think-s", "0", "--rounds", "2"]
        + ["--workload", "chat", "documents", "--question-words", "4"]
        + ["--mock-step-ms", "2", "--out", str(out), "--plot", str(plot)]
    )
    report = json.loads(out.read_text())
    assert report["config"]["out"] == str(out)  # outside the repository: as given
    assert [part["workload"] for part in report["workloads"]] == ["chat", "documents"]
    [part, _] = report["workloads"]
    assert part["question_words"] == 4 and part["answer_tokens"] == 4  # the flags win
    assert "--kv-cache-memory" in part["server_args"]
    assert len(part["rounds"]) == 2 and part["ratios"] == []  # no baseline in this run
    [setup] = part["setups"]
    assert setup["setup"] == "router" and setup["errors"] == 0
    assert sum(setup["requests_per_replica"]) == 6
    assert setup["prefix_queries"] > 0 and 0 < setup["hit_rate"] < 1
    assert set(setup["turn_ttft_p50_s"]) == {"1", "2"}
    assert plot.stat().st_size > 10_000
