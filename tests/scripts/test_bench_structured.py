"""bench_structured.py's smallest run, on the mock: both sides measured, a ratio per stream
count, the corpus compiled."""

from __future__ import annotations

import json

import bench_structured


def test_smallest_run_reports_ratios_and_compile_times(tmp_path, capsys):
    out = tmp_path / "structured.json"
    argv = ["--model", "mock", "--rounds", "1", "--max-tokens", "8", "--streams", "1", "4"]
    assert bench_structured.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert " 1 streams:" in printed and " 4 streams:" in printed and "ratio" in printed
    figures = json.loads(out.read_text())
    assert [r["streams"] for r in figures["rounds"]] == [1, 4]
    assert all(r["free"] > 0 and r["json_schema"] > 0 for r in figures["rounds"])
    assert len(figures["compile_ms"]) >= 30
