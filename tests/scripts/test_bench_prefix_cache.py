"""The paged KV cache's evidence script, smallest run on the mock: both sides of each
comparison answer, and prefix caching computes fewer prompt tokens."""

from __future__ import annotations

import json
from pathlib import Path

import bench_prefix_cache
import pytest


@pytest.mark.slow
def test_mock_run_reports_the_ratios(tmp_path):
    out = tmp_path / "prefix.json"
    argv = ["--model", "mock", "--only", "multi-turn", "shared-prompt", "--rounds", "1"]
    assert bench_prefix_cache.main([*argv, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    turns = figures["multi_turn"]
    # one conversation (--rounds 1) of five turns a side; its turn-5 ratio is the median
    assert [len(c) for c in turns["ttft_ms_on"]] == [len(c) for c in turns["ttft_ms_off"]] == [5]
    assert turns["turn5_ratios"] == [turns["ttft_ms_on"][0][-1] / turns["ttft_ms_off"][0][-1]]
    assert turns["turn5_ratio"] == turns["turn5_ratios"][0]
    shared = figures["shared_prompt"]
    assert shared["on_computed"][0] < shared["off_computed"][0]
    assert 0 < shared["computed_ratio"] < 0.2


@pytest.mark.slow
def test_decode_against_a_baseline_checkout_places_the_time(tmp_path):
    """This checkout against itself as the baseline: both sides answer every wave of every
    round (the order flips each round), and each ratio comes with the model-step one."""
    out = tmp_path / "decode.json"
    repo = Path(__file__).resolve().parents[2]
    argv = ["--model", "mock", "--only", "decode", "--baseline", str(repo), "--rounds", "2"]
    assert bench_prefix_cache.main([*argv, "--json", str(out)]) == 0
    decode = json.loads(out.read_text())["decode"]
    for streams in ("1", "16", "64"):
        for side in ("paged", "baseline"):
            assert len(decode["tok_s"][side][streams]) == 2
            assert all(rate > 0 for rate in decode["tok_s"][side][streams])
            assert all(ms > 0 for ms in decode["model_step_ms_per_token"][side][streams])
        assert decode[f"{streams}_streams_ratio"] > 0
        assert decode[f"{streams}_streams_step_ms_ratio"] > 0
