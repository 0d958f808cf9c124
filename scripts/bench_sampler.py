"""Benchmark the sampler's cost per step with and without logits processors at 1/16/64 rows
and prompts of 20 and 1,500 tokens (``scenarios/sampler_cost.py``; no model, no HTTP).

    python scripts/bench_sampler.py                 # 1, 16, 64 rows, 15 trials
    python scripts/bench_sampler.py --quick         # the smallest run (tests)

Prints, per batch size, the median ms per step of each configuration and the ratios
``plain / bare`` (what the pipeline costs rows that use no processor),
``processors / plain`` (what every processor on every row costs) and
``greedy+penalties / greedy``; then the penalised configurations at each longer prompt.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from scenarios.sampler_cost import SamplerCost, measure_sampler_cost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64", help="batch sizes, comma-separated")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="sample calls per timing")
    parser.add_argument(
        "--prompt-tokens",
        default="20,1500",
        help="prompt lengths, comma-separated; the first is the main table's",
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 and 4 rows, 20/200 tokens, 2 trials, 1 step"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    rows = [1, 4] if args.quick else [int(r) for r in args.rows.split(",")]
    trials, steps = (2, 1) if args.quick else (args.trials, args.steps)
    prompt_tokens = (
        (20, 200) if args.quick else tuple(int(p) for p in args.prompt_tokens.split(","))
    )
    results = measure_sampler_cost(rows, trials, steps, prompt_tokens)
    figures = {str(cost.rows): _figures(cost) for cost in results}
    for cost in results:
        line = figures[str(cost.rows)]
        timings = "  ".join(f"{name} {ms:.3f}" for name, ms in line["median_ms"].items())
        print(
            f"{cost.rows:>3} rows, {prompt_tokens[0]}-token prompts  ms/step: {timings}"
            f"  |  plain/bare {line['plain_over_bare']}"
            f"  processors/plain {line['processors_over_plain']}"
            f"  greedy+pen/greedy {line['greedy_penalties_over_greedy']}"
        )
        for length, longer in line["longer_prompts"].items():
            print(
                f"{'':>3}       {length}-token prompts  ms/step: processors"
                f" {longer['processors']:.3f}  greedy+penalties {longer['greedy+penalties']:.3f}"
                f"  |  greedy+pen/greedy {longer['greedy_penalties_over_greedy']}"
            )
    if args.json:
        args.json.write_text(json.dumps({"rows": figures, "raw": [asdict(r) for r in results]}))
    return 0


def _figures(cost: SamplerCost) -> dict:
    """One batch size's medians and ratios: the first prompt length's configurations in
    ``median_ms``, the penalised ones at each longer prompt under ``longer_prompts``."""
    main = {name: round(ms, 4) for name, ms in cost.median_ms.items() if "@" not in name}
    longer: dict[str, dict[str, float]] = {}
    for name, ms in cost.median_ms.items():
        if "@" in name:
            config, length = name.split("@")
            longer.setdefault(length, {})[config] = round(ms, 4)
    for length, line in longer.items():
        line["greedy_penalties_over_greedy"] = round(
            cost.ratio(f"greedy+penalties@{length}", "greedy"), 3
        )
    return {
        "median_ms": main,
        "plain_over_bare": round(cost.ratio("plain", "bare"), 3),
        "processors_over_plain": round(cost.ratio("processors", "plain"), 3),
        "greedy_penalties_over_greedy": round(cost.ratio("greedy+penalties", "greedy"), 3),
        "longer_prompts": longer,
    }


if __name__ == "__main__":
    raise SystemExit(main())
