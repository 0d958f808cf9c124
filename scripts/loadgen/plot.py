"""One PNG of a run (`--plot`): latency CDFs of TTFT, TPOT and E2E, and tokens/s over time.

Imported only when a plot is asked for: matplotlib is slow to import. Uses the Agg backend, so it
needs no display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.axes import Axes  # noqa: E402

from loadgen.record import Outcome  # noqa: E402
from loadgen.runner import LoadResult  # noqa: E402
from loadgen.stats import tokens_per_second  # noqa: E402

BIN_S = 1.0


def write_plot(result: LoadResult, path: Path) -> None:
    ok = [record for record in result.records if record.outcome is Outcome.OK]
    figure, axes = plt.subplots(2, 2, figsize=(12, 8), layout="constrained")
    samples = {
        "TTFT": [r.ttft_s * 1000 for r in ok if r.ttft_s is not None],
        "TPOT": [r.tpot_s * 1000 for r in ok if r.tpot_s is not None],
        "E2E": [r.e2e_s * 1000 for r in ok],
    }
    for ax, (metric, values_ms) in zip(axes.flat[:3], samples.items(), strict=True):
        draw_cdf(ax, metric, values_ms)
    draw_throughput(axes.flat[3], tokens_per_second(result.records, BIN_S))
    config = result.config
    load = f"concurrency {config.concurrency}" if config.closed_loop else f"rate {config.rate}/s"
    figure.suptitle(
        f"{config.api.value} API, {load}: {result.summary.requests} requests, "
        f"{len(ok)} ok, {result.duration_s:.1f} s"
    )
    figure.savefig(path, dpi=100)
    plt.close(figure)


def draw_cdf(ax: Axes, metric: str, values_ms: Sequence[float]) -> None:
    """Empirical CDF: the fraction of ok requests with latency <= x."""
    ax.set_title(f"{metric} CDF")
    ax.set_xlabel(f"{metric} (ms)")
    ax.set_ylabel("fraction of ok requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ordered = sorted(values_ms)
    fractions = [(rank + 1) / len(ordered) for rank in range(len(ordered))]
    ax.step(ordered, fractions, where="post")


def draw_throughput(ax: Axes, per_bin: Sequence[float]) -> None:
    ax.set_title(f"Output tokens/s ({BIN_S:g} s bins)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    if not per_bin:
        ax.text(0.5, 0.5, "no tokens", ha="center", va="center", transform=ax.transAxes)
        return
    starts = [index * BIN_S for index in range(len(per_bin))]
    ax.bar(starts, per_bin, width=BIN_S, align="edge", edgecolor="white")
