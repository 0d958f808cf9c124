"""scripts/batching_comparison.py end to end: its command line, and what its table must show.
Each run is a process of its own, forked from one that imported the app once
(``tests/forked_cli.py``)."""

from __future__ import annotations

from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "batching_comparison.py"


def table(forked_cli, *args: str) -> dict[tuple[str, str], list[str]]:
    done = forked_cli.run(str(SCRIPT), *args, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "The four runs' outputs are identical." in done.stdout
    rows = [line.strip("|").split("|") for line in done.stdout.splitlines() if line[:2] == "| "]
    header, _alignment, *body = rows
    assert [cell.strip() for cell in header][:3] == ["scheduling", "shape", "calls"]
    return {(cells[0].strip(), cells[1].strip()): [c.strip() for c in cells[2:]] for cells in body}


def test_continuous_beats_static_in_calls_with_the_same_tokens_sent(forked_cli):
    runs = table(forked_cli, "--requests", "40", "--slots", "4", "--seed", "3")
    assert set(runs) == {
        (scheduling, shape)
        for scheduling in ("continuous", "static")
        for shape in ("compacted", "padded")
    }
    calls = {key: int(cells[0]) for key, cells in runs.items()}
    sent = {cells[3] for cells in runs.values()}
    assert calls["continuous", "compacted"] < calls["static", "compacted"]
    assert calls["continuous", "padded"] == calls["continuous", "compacted"]
    assert calls["static", "padded"] == calls["static", "compacted"]
    assert len(sent) == 1  # the same prefixes, in fewer and fuller calls
    assert runs["continuous", "padded"][2] == runs["static", "padded"][2] == "4.00"
    # a fixed shape computes every slot: static batching wastes more rows
    rows = {key: int(cells[-1]) for key, cells in runs.items()}
    assert rows["static", "padded"] > rows["continuous", "padded"] > rows["continuous", "compacted"]


def test_bad_arguments_are_refused(forked_cli):
    done = forked_cli.run(str(SCRIPT), "--slots", "0", timeout=60)
    assert done.returncode == 2 and "--slots must be >= 1" in done.stderr
