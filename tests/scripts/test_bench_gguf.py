"""scripts/bench_gguf.py's server specs (the run itself is a benchmark, not a test)."""

from __future__ import annotations

from pathlib import Path

import pytest
from scenarios.gguf_serving import GGUFBench, our_spec, warm_page_cache


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


def test_the_file_is_read_to_its_end_before_any_system_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * (17 * 2**20 + 5))  # two full chunks and a tail
    read: list[int] = []
    real_open = Path.open

    def counting_open(self: Path, *args: object, **kwargs: object):
        file = real_open(self, *args, **kwargs)  # type: ignore[arg-type]
        real_read = file.read
        file.read = lambda size=-1: (data := real_read(size), read.append(len(data)))[0]
        return file

    monkeypatch.setattr(Path, "open", counting_open)
    warm_page_cache(model)
    assert sum(read) == model.stat().st_size and read[-1] == 0
