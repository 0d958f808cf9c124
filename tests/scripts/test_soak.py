"""A short soak: a real mock server process, cancels, disconnects, bad bodies; nothing leaks."""

from __future__ import annotations

import json

import pytest
import soak

pytestmark = pytest.mark.slow


def test_short_soak_leaks_nothing(tmp_path):
    out = tmp_path / "soak.json"
    status = soak.main(
        ["--num-requests", "300", "--concurrency", "16", "--seed", "7", "--out", str(out)]
    )
    result = json.loads(out.read_text())
    assert status == 0, result["problems"]
    assert result["problems"] == []
    assert result["accepted"] == result["server_finished"] > 0
    outcomes = result["outcomes"]
    assert outcomes.get("stream_deleted", 0) > 0 and outcomes.get("stream_disconnected", 0) > 0
    assert outcomes.get("bad_body_422", 0) > 0
    assert result["server_finished_by_reason"].get("cancelled", 0) > 0
