"""The loop profiler's smallest run: every phase measured, the text side off the critical path."""

from __future__ import annotations

import profile_loop


async def test_a_small_run_measures_every_phase() -> None:
    result = await profile_loop.profile_one(slots=4, steps=20, output_len=8, step_ms=0.0)
    assert result.steps > 0 and result.rows >= result.steps
    costs = result.us_per_row
    assert set(costs) == {*profile_loop.PHASES, profile_loop.OVERLAPPED}
    for phase in ("schedule", "build rows", "apply", "emit"):
        assert costs[phase] > 0, phase
    # the text side (emit_text) runs while the next step runs
    assert 0 < costs[profile_loop.OVERLAPPED] <= costs["apply"] + costs["emit"]
    assert "| **on the critical path** |" in profile_loop.render([result])
