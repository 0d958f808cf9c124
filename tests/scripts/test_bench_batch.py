"""The batch-runner comparison's smallest run: both sides answer every request, a ratio comes
out for each mock workload."""

from __future__ import annotations

import json

import bench_batch
import pytest


@pytest.mark.slow
def test_quick_comparison_reports_a_ratio_per_workload(tmp_path):
    out = tmp_path / "batch.json"
    assert bench_batch.main(["--quick", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures) == {"mock 5 ms/step", "mock 0 ms/step"}
    for workload in figures.values():
        (only,) = workload["rounds"]
        assert only["batch_tok_s"] > 0 and only["http_tok_s"] > 0
        assert only["ratio"] == pytest.approx(only["batch_tok_s"] / only["http_tok_s"])
