"""The paged KV cache's evidence script, smallest run on the mock: both sides of each
comparison answer, and prefix caching computes fewer prompt tokens."""

from __future__ import annotations

import json

import bench_prefix_cache
import pytest


@pytest.mark.slow
def test_mock_run_reports_the_ratios(tmp_path):
    out = tmp_path / "prefix.json"
    argv = ["--model", "mock", "--only", "multi-turn", "shared-prompt", "--rounds", "1"]
    assert bench_prefix_cache.main([*argv, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    turns = figures["multi_turn"]
    assert len(turns["ttft_ms_on"]) == len(turns["ttft_ms_off"]) == 5
    shared = figures["shared_prompt"]
    assert shared["on_computed"][0] < shared["off_computed"][0]
    assert 0 < shared["computed_ratio"] < 0.2
