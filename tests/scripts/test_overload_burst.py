"""A short overload burst against a real mock server: only 200 and 429 come back."""

from __future__ import annotations

import json
import math

import overload_burst
import pytest


@pytest.mark.slow
def test_short_burst_answers_only_200_and_429(tmp_path):
    out = tmp_path / "burst.json"
    # the latency bound is loose here: this checks statuses and the report, not the machine
    status = overload_burst.main(["--duration", "1", "--max-429-p99-ms", "1000", "--out", str(out)])
    result = json.loads(out.read_text())
    assert status == 0, result["problems"]
    assert set(result["by_status"]) == {"200", "429"}
    assert result["by_status"]["429"]["count"] > result["by_status"]["200"]["count"]
    assert 0 < result["server_event_loop_lag_p99_ms_at_most"] < math.inf


def test_bucket_quantile_reads_only_the_samples_between_scrapes():
    before = {0.001: 90.0, 0.01: 100.0, math.inf: 100.0}
    after = {0.001: 95.0, 0.01: 195.0, math.inf: 200.0}  # 100 new: 5 <= 1 ms, 95 <= 10 ms
    assert overload_burst.bucket_quantile(before, after, 0.5) == 0.01
    assert overload_burst.bucket_quantile(before, after, 0.99) == math.inf
    assert overload_burst.bucket_quantile(after, after, 0.5) == math.inf  # nothing new
