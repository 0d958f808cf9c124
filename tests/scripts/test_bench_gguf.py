"""scripts/bench_gguf.py's server specs (the run itself is a benchmark, not a test)."""

from __future__ import annotations

from pathlib import Path

from scenarios.gguf_serving import GGUFBench, our_spec


def _bench() -> GGUFBench:
    return GGUFBench(Path("m.gguf"), ("auto",), None, (1, 16), 1, 8, 2, 512, 100, Path("logs"))


def test_modes_name_quantization_wide_copies_and_another_checkout() -> None:
    plain = our_spec(_bench(), "auto+off").argv
    assert plain[1:3] == ("-m", "app")
    assert plain[plain.index("--quantization") + 1] == "auto"
    assert plain[plain.index("--wide-copies") + 1] == "off"
    before = our_spec(_bench(), "int4@/tmp/before").argv
    assert before[1] == "-c" and "sys.path.insert(0, '/tmp/before')" in before[2]
    assert before[3] == "serve" and before[before.index("--quantization") + 1] == "int4"
    assert "--wide-copies" not in before
