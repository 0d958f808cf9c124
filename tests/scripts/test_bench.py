"""The benchmark driver (scripts/bench.py, scripts/scenarios/): its smallest run end to end on
the mock, and the pure helpers its numbers rest on (bucket quantiles, the scheduling
simulation)."""

from __future__ import annotations

import argparse
import json
import math
import re

import bench
import pytest
from harness.metrics import HistogramDelta
from scenarios.scheduling import predicted_model_calls
from scenarios.suite import parse_scenarios

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def histogram(bounds: list[float], per_bucket: list[float], total: float) -> HistogramDelta:
    cumulative, running = [], 0.0
    for count in per_bucket:
        running += count
        cumulative.append(running)
    return HistogramDelta(tuple(bounds), tuple(cumulative), total)


def test_bucket_quantile_interpolates_like_prometheus() -> None:
    h = histogram([0.01, 0.02, math.inf], [10, 10, 0], total=0.25)
    assert h.count == 20
    assert h.mean == pytest.approx(0.0125)
    assert h.quantile(0.5) == pytest.approx(0.01)  # rank 10: the top of the first bucket
    assert h.quantile(0.25) == pytest.approx(0.005)  # first bucket starts at 0
    assert h.quantile(0.75) == pytest.approx(0.015)
    assert h.bucket_counts() == [(0.01, 10), (0.02, 10), (math.inf, 0)]


def test_bucket_quantile_in_the_inf_bucket_is_the_largest_finite_bound() -> None:
    assert histogram([0.01, math.inf], [1, 9], 1.0).quantile(0.99) == 0.01
    assert histogram([0.01, math.inf], [0, 0], 0.0).quantile(0.5) is None


def test_predicted_model_calls_continuous_refills_static_waits_for_the_batch() -> None:
    lengths = [10, 1, 1, 1]
    # continuous, 2 slots: 10 runs throughout, the three 1s take a step each beside it
    assert predicted_model_calls(lengths, 2, "continuous") == 10
    # static, 2 slots: batches (10, 1) then (1, 1)
    assert predicted_model_calls(lengths, 2, "static") == 11
    assert predicted_model_calls([], 4, "static") == 0


def test_scenarios_flag_is_validated() -> None:
    assert parse_scenarios("5,1,1") == (1, 5)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_scenarios("6")


@pytest.mark.slow
def test_quick_run_writes_markdown_json_and_pngs(tmp_path) -> None:
    assert bench.main(["--quick", "--out-dir", str(tmp_path)]) == 0

    markdown = (tmp_path / "BENCHMARKS.md").read_text()
    results = json.loads((tmp_path / "bench_results.json").read_text())
    assert results["schema"] == "slotserve-bench/1"
    assert results["repeats"] == 1 and results["quick"] is True
    assert results["machine_before"]["cpus"] >= 1
    scenarios = results["scenarios"]
    assert set(scenarios) == {"1", "2", "3", "4", "5"}

    for number in "12345":
        assert f"## {number}. " in markdown
    assert markdown.count("**Reproduce:** `python scripts/bench.py --scenarios") == 5
    # scenario 4 is SmolLM2 only: skipped with a note; scenario 3 notes its skipped half
    assert scenarios["4"]["skipped"] and "Skipped" in markdown
    assert any("SmolLM2" in note for note in scenarios["3"]["notes"])

    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", markdown)
    assert len(images) == 4  # one per scenario that ran
    for image in images:
        assert (tmp_path / image).read_bytes()[:8] == PNG_MAGIC

    s1 = scenarios["1"]["medians"]
    assert s1["ideal_tok_s"] == 6400
    assert s1["failed_requests"] == 0, s1
    assert 0 < s1["delivered_over_ideal"] <= 1.05, s1
    assert 0 < s1["server_over_ideal"] <= 1.05, s1
    assert 0 < s1["mean_batch_size"] <= 64, s1

    s2 = scenarios["2"]["medians"]
    for target in ("full", "sse", "bare"):
        assert s2[f"{target}.tok_s"] > 0 and s2[f"{target}.failed_requests"] == 0
    assert s2["full_over_bare"] == pytest.approx(s2["full.tok_s"] / s2["bare.tok_s"])

    s3 = scenarios["3"]["medians"]
    for policy in ("continuous", "static"):
        # ignore_eos: every request generates exactly its drawn length
        assert s3[f"mock.{policy}.generated_tokens"] == s3[f"mock.{policy}.requested_tokens"]
        assert s3[f"mock.{policy}.failed_requests"] == 0
    assert s3["mock.continuous.model_calls"] < s3["mock.static.model_calls"]
    assert s3["mock.ratio.model_calls"] < 1

    s5 = scenarios["5"]["medians"]
    assert s5["cancelled_share"] > 0 and s5["server_cancels"] > 0
    assert s5["cancel_to_free_count"] > 0 and s5["cancel_to_free_mean_ms"] > 0
    assert 0 < s5["recovery"] <= 1.5
    assert s5["failed_requests"] == 0
    assert f"{s5['cancel_to_free_mean_ms']:.2f}" in markdown


class _Counted:
    """A window standing in for harness.measure.Window: one counter value, which is also the
    count of tokens the client received."""

    def __init__(self, generated: float) -> None:
        self.generated = generated

    def counter(self, name: str, **labels: str) -> float:
        assert name == "slotserve_generated_tokens_total"
        return self.generated

    def tokens_received(self, records: list) -> float:
        return self.generated


class _Marked:
    """A run standing in for harness.measure.Run: its steady window and its whole."""

    def __init__(self, steady: _Counted, whole: _Counted) -> None:
        self.steady, self.everything = steady, whole

    def window(self) -> _Counted:
        return self.steady

    def whole(self) -> _Counted:
        return self.everything

    def records(self) -> list:
        return []


def test_cancel_storm_rates_fall_back_to_the_whole_run_when_the_window_saw_no_tokens() -> None:
    """The failing input of the quick run's flake: a busy machine delayed the mock past the
    baseline's window, whose generated-token count was 0, and scenario 5's recovery came out
    None."""
    from scenarios.cancel_storm import steady_windows

    empty, busy = _Counted(0.0), _Counted(96.0)
    base_whole, storm_whole, storm_busy = _Counted(480.0), _Counted(400.0), _Counted(90.0)
    # either window empty: both runs whole (one whole against one window skewed the ratio)
    assert steady_windows(_Marked(empty, base_whole), _Marked(storm_busy, storm_whole)) == (
        base_whole,
        storm_whole,
    )
    assert steady_windows(_Marked(busy, base_whole), _Marked(empty, storm_whole)) == (
        base_whole,
        storm_whole,
    )
    assert steady_windows(_Marked(busy, base_whole), _Marked(storm_busy, storm_whole)) == (
        busy,
        storm_busy,
    )


def test_sse_ceiling_rates_fall_back_to_the_whole_runs_when_a_window_received_no_tokens() -> None:
    """The failing input of the quick run's scenario 2 flake: the client, busy, sent nothing
    to the ceiling within the sse-starlette target's window (0 tok/s received, the server idle,
    no failed request), and that target's rate came out 0."""
    from scenarios.sse_ceiling import steady_windows

    full, sse, bare = _Counted(3700.0), _Counted(0.0), _Counted(13600.0)
    wholes = {"full": _Counted(6000.0), "sse": _Counted(9000.0), "bare": _Counted(21000.0)}
    steady = {"full": full, "sse": sse, "bare": bare}
    runs = {name: _Marked(steady[name], wholes[name]) for name in steady}
    assert steady_windows(runs) == wholes
    sse.generated = 8000.0
    assert steady_windows(runs) == steady
