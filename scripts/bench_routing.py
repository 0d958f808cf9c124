"""Multi-turn chats over 3 replicas: the cache-aware router (vllm-router) against nginx, in one run
(``scenarios/routing.py``): prefix-cache hit rate, TTFT by turn, throughput, and a plot.

    python scripts/bench_routing.py                       # mock replicas, every setup
    python scripts/bench_routing.py --model smollm2 --conversations 12 --answer-tokens 16
    python scripts/bench_routing.py --setups router router-round-robin   # without nginx

Everything runs on 127.0.0.1 and is stopped at the end; nginx (apt) and vllm-router (the bench
extra) must be installed for the setups that use them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from scenarios.routing import SETUPS, RoutingBench, SetupResult, compare, print_table


def server_args(
    model: str, step_ms: float, slots: int, step_tokens: int, kv_cache_memory: str | None
) -> tuple[str, ...]:
    """Replica flags. The mock costs one ``step_ms`` step per ``step_tokens`` prompt tokens
    (``--max-num-batched-tokens``), so a prefix found in the cache saves it steps as a real
    model saves prefill work; ``kv_cache_memory`` bounds what a replica can keep cached."""
    flags = ("--model", model, "--max-num-seqs", str(slots), "--no-warmup")
    flags += ("--max-num-batched-tokens", str(step_tokens))
    if kv_cache_memory is not None:
        flags += ("--kv-cache-memory", kv_cache_memory)
    if model == "mock":
        flags += ("--mock-step-ms", f"{step_ms:g}")
    return flags


def write_plot(results: Sequence[SetupResult], turns: int, path: Path) -> None:
    """One PNG: TTFT p50 by turn, the hit rates and the throughput of every setup (matplotlib
    imported here: it is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_turn, hits, speed) = plt.subplots(1, 3, figsize=(15, 4.5), layout="constrained")
    names = [r.setup for r in results]
    for r in results:
        turn_numbers = sorted(r.turn_ttft_p50_s)
        by_turn.plot(turn_numbers, [r.turn_ttft_p50_s[t] * 1000 for t in turn_numbers], "o-")
    by_turn.set(xlabel="turn", ylabel="TTFT p50 (ms)", title="Time to first token by turn")
    by_turn.set_xticks(range(1, turns + 1))
    by_turn.legend(names)
    places = range(len(names))
    hits.bar([x - 0.2 for x in places], [r.hit_rate * 100 for r in results], 0.4)
    hits.bar([x + 0.2 for x in places], [r.history_hit_rate * 100 for r in results], 0.4)
    hits.set_xticks(list(places), names)
    hits.set_ylim(0, 115)
    hits.legend(["all prompt tokens", "the conversation's own"], loc="upper center", ncols=2)
    hits.set(ylabel="% of prompt tokens found cached", title="Prefix-cache hit rate (replicas)")
    speed.bar(names, [r.tokens_per_s for r in results], color="tab:blue")
    speed.set(ylabel="completion tokens / s", title="Throughput")
    for axes in (hits, speed):
        axes.tick_params(axis="x", rotation=20)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS[:3]))
    parser.add_argument("--model", default="mock", help="mock | smollm2 | PATH")
    parser.add_argument("--mock-step-ms", type=float, default=20.0, help="mock: time of a step")
    parser.add_argument("--step-tokens", type=int, default=64, help="--max-num-batched-tokens")
    parser.add_argument(
        "--kv-cache-memory",
        help="each replica's KV pool (mock: 4 bytes a position); default: "
        "the server's (room for every chat, so nothing is ever evicted)",
    )
    parser.add_argument("--slots", type=int, default=8, help="--max-num-seqs of each replica")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--question-words", type=int, default=8)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--think-s", type=float, default=1.0, help="mean pause between turns")
    parser.add_argument("--out", type=Path, default=Path("results-routing.json"))
    parser.add_argument("--plot", type=Path, default=Path("results-routing.png"))
    args = parser.parse_args(argv)
    bench = RoutingBench(
        setups=tuple(args.setups),
        server_args=server_args(
            args.model, args.mock_step_ms, args.slots, args.step_tokens, args.kv_cache_memory
        ),
        replicas=args.replicas,
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=args.system_tokens,
        question_words=args.question_words,
        answer_tokens=args.answer_tokens,
        think_s=args.think_s,
    )
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        results = compare(bench, Path(tmp))
    print_table(results, bench.turns)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = {"config": config, "setups": [asdict(r) for r in results]}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    write_plot(results, bench.turns, args.plot)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
