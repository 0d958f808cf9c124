"""The kernel A/B benchmark's smallest run: this checkout against itself gives the same bits
and a ratio for every shape and row count."""

from __future__ import annotations

import json
from pathlib import Path

import bench_kernels_ab
import pytest

from app.models.kernels.ggml_quant import load_ggml_quant

KERNELS, _ = load_ggml_quant()


@pytest.mark.skipif(KERNELS is None, reason="the GGUF-block kernels do not build here")
def test_a_checkout_against_itself(tmp_path) -> None:
    out = tmp_path / "ab.json"
    root = Path(bench_kernels_ab.__file__).resolve().parents[1]
    argv = ["--base", str(root), "--shapes", "Q4_1:64x96,Q4_K:16x256", "--rows", "1,9"]
    argv += ["--rounds", "2", "--calls", "1", "--json", str(out)]
    assert bench_kernels_ab.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["shapes"]) == {"Q4_1:64x96", "Q4_K:16x256"}
    for lines in report["shapes"].values():
        assert set(lines) == {"1", "9"}
        assert all(line["new_us"] > 0 and line["new_over_base"] > 0 for line in lines.values())
