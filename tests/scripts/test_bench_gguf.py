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


def test_servers_keep_the_kernel_choice_of_the_environment() -> None:
    """A benchmark's server runs on its command line alone, but for the kernels' variables:
    docs/MODEL_PERF.md's AVX2-code runs set SLOTSERVE_GGML_ISA=avx2 for our server beside
    llama.cpp's AVX2 build (dropped with the other SLOTSERVE_ variables, our kernels ran
    AVX-512 against it)."""
    from harness.server import server_environment  # noqa: PLC0415

    environ = {
        "SLOTSERVE_GGML_ISA": "avx2",
        "SLOTSERVE_GGML_HEAD_SKETCH": "0",
        "SLOTSERVE_MODEL": "mock",
        "SLOTSERVE_MAX_NUM_SEQS": "3",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "PATH": "/usr/bin",
    }
    assert server_environment(environ) == {
        "SLOTSERVE_GGML_ISA": "avx2",
        "SLOTSERVE_GGML_HEAD_SKETCH": "0",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "PATH": "/usr/bin",
    }
