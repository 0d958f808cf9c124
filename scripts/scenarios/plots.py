"""The PNGs of `bench.py`, one function per picture; each takes plain numbers and a path.

matplotlib runs headless (Agg). Every figure has a title, axis labels with units, and a legend
when it shows more than one thing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.axes import Axes  # noqa: E402

DPI = 110


def save(figure: plt.Figure, path: Path) -> None:
    figure.savefig(path, dpi=DPI)
    plt.close(figure)


def saturation(
    path: Path,
    bin_s: float,
    tok_s: Sequence[float],
    ideal_tok_s: float,
    window: tuple[float, float],
    title: str,
) -> None:
    """Scenario 1: delivered tokens/s over time against the ideal, steady window shaded."""
    figure, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    starts = [index * bin_s for index in range(len(tok_s))]
    ax.bar(
        starts,
        tok_s,
        width=bin_s,
        align="edge",
        color="tab:blue",
        alpha=0.8,
        label=f"delivered to clients ({bin_s:g} s bins)",
    )
    ax.axhline(ideal_tok_s, color="tab:red", linestyle="--", label=f"ideal {ideal_tok_s:.0f} tok/s")
    ax.axvspan(*window, color="tab:green", alpha=0.1, label="steady window (measured)")
    ax.set(title=title, xlabel="time since the run's start (s)", ylabel="output tokens/s")
    ax.set_ylim(0, ideal_tok_s * 1.35)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", ncol=3, fontsize=9)
    save(figure, path)


def grouped_bars(
    path: Path,
    groups: Sequence[str],
    series: Mapping[str, Sequence[tuple[float, float, float]]],
    title: str,
    ylabel: str,
) -> None:
    """Bars of medians with min-max whiskers: one group per x label, one bar per series.
    ``series[name][i]`` is (median, min, max) for ``groups[i]``."""
    figure, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    width = 0.8 / max(1, len(series))
    for offset, (name, values) in enumerate(series.items()):
        xs = [i + (offset - (len(series) - 1) / 2) * width for i in range(len(groups))]
        medians = [v[0] for v in values]
        errors = [[v[0] - v[1] for v in values], [v[2] - v[0] for v in values]]
        bars = ax.bar(xs, medians, width=width, yerr=errors, capsize=4, label=name)
        ax.bar_label(bars, labels=[f"{m:,.0f}" for m in medians], padding=2, fontsize=8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    save(figure, path)


def ttft_cdfs(path: Path, panels: Mapping[str, Mapping[str, Sequence[float]]], title: str) -> None:
    """Scenario 3: one panel per model, one empirical TTFT CDF per scheduling policy."""
    figure, axes = plt.subplots(
        1, len(panels), figsize=(6 * len(panels), 4.5), layout="constrained", squeeze=False
    )
    for ax, (panel, curves) in zip(axes[0], panels.items(), strict=True):
        for label, values_ms in curves.items():
            draw_cdf(ax, values_ms, label)
        ax.set(title=panel, xlabel="TTFT (ms)", ylabel="fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    figure.suptitle(title)
    save(figure, path)


def draw_cdf(ax: Axes, values: Sequence[float], label: str) -> None:
    ordered = sorted(values)
    if not ordered:
        return
    fractions = [(rank + 1) / len(ordered) for rank in range(len(ordered))]
    ax.step(ordered, fractions, where="post", label=f"{label} (n={len(ordered)})")


def concurrency_sweep(
    path: Path,
    levels: Sequence[int],
    tok_s: Sequence[float],
    latencies_ms: Mapping[str, Sequence[float | None]],
    title: str,
) -> None:
    """Scenario 4: tokens/s vs concurrency, and TTFT/TPOT percentiles vs concurrency."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    left.plot(levels, tok_s, marker="o")
    for level, value in zip(levels, tok_s, strict=True):
        left.annotate(
            f"{value:.0f}",
            (level, value),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    left.set(
        title="output tokens/s",
        xlabel="concurrency (requests in flight)",
        ylabel="output tokens/s",
        xscale="log",
    )
    left.set_xticks(levels, [str(level) for level in levels])
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    for label, values in latencies_ms.items():
        points = [(x, y) for x, y in zip(levels, values, strict=True) if y is not None]
        right.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    right.set(
        title="latency",
        xlabel="concurrency (requests in flight)",
        ylabel="ms (log)",
        xscale="log",
        yscale="log",
    )
    right.set_xticks(levels, [str(level) for level in levels])
    right.grid(alpha=0.3, which="both")
    right.legend()
    figure.suptitle(title)
    save(figure, path)


def cancel_storm(
    path: Path,
    bin_s: float,
    rates: Mapping[str, Sequence[float]],
    buckets_ms: Sequence[tuple[float, float]],
    title: str,
) -> None:
    """Scenario 5: tokens/s over time (baseline vs storm), and the cancel-to-free buckets."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), layout="constrained")
    for label, series in rates.items():
        times = [(index + 0.5) * bin_s for index in range(len(series))]
        left.plot(times, series, marker=".", label=label)
    left.set(
        title=f"tokens/s received ({bin_s:g} s bins)",
        xlabel="time since start (s)",
        ylabel="output tokens/s",
    )
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    left.legend(loc="lower center")
    labels, counts, lower = [], [], 0.0
    for upper, count in buckets_ms:
        labels.append(f"{lower:g}-{upper:g}" if upper != float("inf") else f">{lower:g}")
        counts.append(count)
        lower = upper
    right.bar(range(len(counts)), counts)
    right.set_xticks(range(len(counts)), labels, rotation=45, ha="right")
    right.set(
        title="cancel -> slot free (server histogram)", xlabel="bucket (ms)", ylabel="cancels"
    )
    right.grid(axis="y", alpha=0.3)
    figure.suptitle(title)
    save(figure, path)
