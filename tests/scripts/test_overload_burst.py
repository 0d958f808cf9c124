"""A short overload burst against a real mock server: only 200 and 429 come back."""

from __future__ import annotations

import json
import math

import overload_burst
import pytest
from harness.metrics import Metrics, histogram_delta


@pytest.mark.slow
def test_short_burst_answers_only_200_and_429(tmp_path):
    out = tmp_path / "burst.json"
    # the latency bound is loose here: this checks statuses and the report, not the machine
    status = overload_burst.main(["--duration", "1", "--max-429-p99-ms", "1000", "--out", str(out)])
    result = json.loads(out.read_text())
    assert status == 0, result["problems"]
    assert set(result["by_status"]) == {"200", "429"}
    assert result["by_status"]["429"]["count"] > result["by_status"]["200"]["count"]
    assert 0 < result["server_event_loop_lag_p99_ms"] < math.inf


def lag_scrape(cumulative: dict[float, float]) -> Metrics:
    name = "slotserve_event_loop_lag_seconds"
    samples = {(f"{name}_bucket", (("le", str(le)),)): count for le, count in cumulative.items()}
    samples[(f"{name}_sum", ())] = 0.0
    return Metrics(samples)


def test_the_burst_quantile_reads_only_the_samples_between_scrapes():
    """The one quantile of the harness (Prometheus' interpolation) over the scrapes' delta."""
    before = lag_scrape({0.001: 90.0, 0.01: 100.0, math.inf: 100.0})
    after = lag_scrape({0.001: 95.0, 0.01: 195.0, math.inf: 200.0})  # 100 new: 5 <= 1 ms
    lag = histogram_delta(before, after, "slotserve_event_loop_lag_seconds")
    assert lag.count == 100
    assert lag.quantile(0.5) == pytest.approx(0.001 + 0.009 * 45 / 90)  # inside (1, 10] ms
    assert lag.quantile(0.99) == 0.01  # in the +Inf bucket: the largest finite bound
    nothing_new = histogram_delta(after, after, "slotserve_event_loop_lag_seconds")
    assert nothing_new.quantile(0.5) is None
