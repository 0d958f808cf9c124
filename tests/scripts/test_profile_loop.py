"""The loop profiler's smallest run: every phase measured, and the time between two steps."""

from __future__ import annotations

import profile_loop


async def test_a_small_run_measures_every_phase() -> None:
    result = await profile_loop.profile_one(slots=4, steps=20, output_len=8, step_ms=0.0)
    assert result.steps > 0 and result.rows >= result.steps
    costs = result.us_per_row
    assert set(costs) == set(profile_loop.PHASES)
    for phase in ("schedule", "build rows", "apply", "emit"):
        assert costs[phase] > 0, phase
    assert result.between_steps_ms >= 0
    assert "| **between two steps, ms" in profile_loop.render([result])


async def test_steps_built_after_their_predecessor_are_profiled_too() -> None:
    result = await profile_loop.profile_one(
        slots=4, steps=20, output_len=8, step_ms=0.0, schedule_ahead=False
    )
    assert result.steps > 0 and result.us_per_row["schedule"] > 0
