"""The sampler benchmark's smallest run: every configuration timed, the ratios reported."""

from __future__ import annotations

import json

import bench_sampler


def test_quick_run_reports_the_ratios(tmp_path) -> None:
    out = tmp_path / "sampler.json"
    assert bench_sampler.main(["--quick", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["rows"]
    assert set(figures) == {"1", "4"}
    for line in figures.values():
        assert set(line["median_ms"]) == {
            "bare",
            "plain",
            "processors",
            "greedy",
            "greedy+penalties",
        }
        assert all(ms > 0 for ms in line["median_ms"].values())
        assert line["plain_over_bare"] > 0 and line["processors_over_plain"] > 0
        longer = line["longer_prompts"]["200"]  # the penalised configurations, a longer prompt
        assert set(longer) == {"processors", "greedy+penalties", "greedy_penalties_over_greedy"}
        assert all(value > 0 for value in longer.values())
