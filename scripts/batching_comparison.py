"""The seed's comparison (``seeds/003``): continuous against static batching, in model calls and
in prefix tokens sent per call, on skewed output lengths, all from ``app.offline.generate``.

    python scripts/batching_comparison.py                      # 64 requests on 8 slots
    python scripts/batching_comparison.py --requests 256 --slots 16 --seed 1

The model is the seed's stateless mock (``app.models.mock.MockModel``: it re-reads every
prefix) behind a recorder of each call. Output lengths are skewed: each request's
``max_tokens`` is drawn from a log-normal (median ``--median-tokens``, sigma ``--sigma``,
clipped to 1..``--max-tokens``), and the mock's EOS, the stop token, is rare
(``--eos-one-in``), so most requests run to their drawn length. Prompts are 8-64 tokens.

Four runs of the same requests: continuous and static admission (``scheduling=``), each with
compacted calls and with the fixed batch shape (``pad_to_slots=True``). All four must give the
same outputs (the script checks). Prints a Markdown table:

- calls: ``next_tokens`` calls; the lower bound is max(longest output, ceil(total / slots));
- entries/call: sequences per call (padding included for the padded runs);
- prefix tokens sent: summed over every entry of every call, total and per call. A stateless
  model reads each live request's whole prefix once a step whatever the policy, so the total
  is the same for all four; continuous batching sends it in fewer, fuller calls, which is what
  a model with a per-call cost (a kernel launch, a weight read, a fixed shape) pays for;
- rows computed: calls x entries, what a fixed-shape backend computes (padding included).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.models.mock import MOCK_EOS_TOKEN_ID, MockModel  # noqa: E402
from app.offline import Request, generate  # noqa: E402


@dataclass(slots=True)
class RecordingModel:
    """``MockModel`` plus a log of each call: entries and prefix tokens."""

    model: MockModel
    entries: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        self.entries.append(len(batch))
        self.tokens.append(sum(len(prefix) for prefix in batch))
        return self.model.next_tokens(batch)


@dataclass(frozen=True, slots=True)
class Run:
    """One ``generate`` run's counts.

    Attributes:
        scheduling: ``"continuous"`` or ``"static"``.
        padded: ``pad_to_slots``.
        calls: ``next_tokens`` calls.
        rows: entries over all calls (padding included).
        prefix_tokens: tokens over all entries of all calls.
        max_call_tokens: the largest call, in prefix tokens.
        outputs: ``generate``'s result.
    """

    scheduling: str
    padded: bool
    calls: int
    rows: int
    prefix_tokens: int
    max_call_tokens: int
    outputs: dict[str, list[int]]


def make_requests(
    count: int, *, seed: int, median_tokens: float, sigma: float, max_tokens: int
) -> list[Request]:
    """``count`` requests, prompts of 8-64 lowercase-letter tokens, skewed ``max_tokens``."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        prompt = [rng.randrange(97, 123) for _ in range(rng.randint(8, 64))]
        drawn = round(rng.lognormvariate(math.log(median_tokens), sigma))
        requests.append(Request(f"r{index}", prompt, min(max(drawn, 1), max_tokens)))
    return requests


def run(
    requests: list[Request], slots: int, *, scheduling: str, padded: bool, eos_one_in: int
) -> Run:
    model = RecordingModel(MockModel(eos_one_in=eos_one_in))
    outputs = generate(
        model, requests, slots, MOCK_EOS_TOKEN_ID, pad_to_slots=padded, scheduling=scheduling
    )
    return Run(
        scheduling=scheduling,
        padded=padded,
        calls=len(model.entries),
        rows=sum(model.entries),
        prefix_tokens=sum(model.tokens),
        max_call_tokens=max(model.tokens, default=0),
        outputs=outputs,
    )


def compare(requests: list[Request], slots: int, *, eos_one_in: int) -> list[Run]:
    """The four runs; raises RuntimeError if their outputs differ."""
    runs = [
        run(requests, slots, scheduling=scheduling, padded=padded, eos_one_in=eos_one_in)
        for padded in (False, True)
        for scheduling in ("continuous", "static")
    ]
    if any(r.outputs != runs[0].outputs for r in runs):
        raise RuntimeError("the runs gave different outputs")
    return runs


def render(requests: list[Request], slots: int, runs: list[Run]) -> str:
    lengths = sorted(len(tokens) for tokens in runs[0].outputs.values())
    stopped = sum(tokens[-1:] == [MOCK_EOS_TOKEN_ID] for tokens in runs[0].outputs.values())
    total = sum(lengths)
    bound = max(lengths[-1], -(-total // slots)) if lengths else 0
    continuous = runs[0].calls
    lines = [
        f"{len(requests)} requests on {slots} slots; output lengths (tokens): min {lengths[0]}, "
        f"median {lengths[len(lengths) // 2]}, p90 {lengths[int(len(lengths) * 0.9)]}, "
        f"max {lengths[-1]}, total {total}; {stopped} ended by the stop token. "
        f"Lower bound on calls: {bound}. The four runs' outputs are identical.",
        "",
        "| scheduling | shape | calls | vs continuous | entries/call | prefix tokens sent "
        "| tokens/call (mean, max) | rows computed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        lines.append(
            f"| {r.scheduling} | {'padded' if r.padded else 'compacted'} | {r.calls} "
            f"| {r.calls / continuous:.2f}x | {r.rows / r.calls:.2f} | {r.prefix_tokens} "
            f"| {r.prefix_tokens / r.calls:.0f}, {r.max_call_tokens} | {r.rows} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--median-tokens", type=float, default=16.0)
    parser.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma (skew)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--eos-one-in", type=int, default=200)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.slots < 1:
        parser.error("--requests and --slots must be >= 1")
    requests = make_requests(
        args.requests,
        seed=args.seed,
        median_tokens=args.median_tokens,
        sigma=args.sigma,
        max_tokens=args.max_tokens,
    )
    print(render(requests, args.slots, compare(requests, args.slots, eos_one_in=args.eos_one_in)))


if __name__ == "__main__":
    main()
