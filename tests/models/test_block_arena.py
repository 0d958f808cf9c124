"""A GGUF load's blocks in 2 MiB pages (``app.models.weights.block_arena``): the bytes are the
file's, every projection's blocks live in the arena, and a kernel without transparent huge
pages keeps the file's mapped bytes instead."""

from __future__ import annotations

import ctypes
import mmap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from make_random_gguf import write_random_gguf

from app.models.kernels.ggml_quant import load_ggml_quant
from app.models.weights import block_arena, block_arena_prefault
from app.models.weights.block_arena import ALIGN, BlockArena, huge_pages_mode
from app.models.weights.ggml import GGMLLinear
from tests.models.stepping import load_on_blocks

SHAPE = {"hidden": 256, "ffn": 512, "layers": 2, "heads": 4, "kv_heads": 2}


@pytest.fixture(scope="module")
def random_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arena") / "model.gguf"
    return write_random_gguf(out, types="Q4_K,Q6_K,Q8_0", **SHAPE)


@pytest.mark.parametrize(
    ("setting", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", None),
    ],
)
def test_the_kernels_mode_is_read_from_sysfs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, mode: str | None
) -> None:
    path = tmp_path / "enabled"
    path.write_text(setting)
    monkeypatch.setattr(block_arena_prefault, "THP_SETTING", path)
    assert huge_pages_mode() == mode
    monkeypatch.setattr(block_arena_prefault, "THP_SETTING", tmp_path / "missing")
    assert huge_pages_mode() is None


def test_take_copies_the_bytes_aligned_and_releases_nothing_it_owns() -> None:
    arena = BlockArena(3 << 20)
    rng = np.random.default_rng(0)
    first = rng.integers(0, 256, size=(3, 37), dtype=np.uint8)
    second = rng.integers(0, 256, size=(5, 144), dtype=np.uint8)
    a, b = arena.take(first), arena.take(second)
    assert torch.equal(a, torch.from_numpy(first)) and torch.equal(b, torch.from_numpy(second))
    assert b.data_ptr() % ALIGN == 0 and b.data_ptr() - a.data_ptr() == 128  # 111 -> 128
    assert arena.used == 128 + second.nbytes
    with pytest.raises(MemoryError):
        arena.take(np.zeros((4 << 20,), dtype=np.uint8))


def test_a_matrix_is_copied_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_arena, "COPY_BYTES", 100)  # 2 rows of 37 bytes a part
    rows = np.random.default_rng(1).integers(0, 256, size=(21, 37), dtype=np.uint8)
    assert torch.equal(BlockArena(1 << 20).take(rows), torch.from_numpy(rows))


def test_a_file_views_pages_are_released_once_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(block_arena, "COPY_BYTES", mmap.PAGESIZE + 1)  # a page a part
    page = mmap.PAGESIZE
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * (4 * page // 256))
    view = np.memmap(path, dtype=np.uint8, mode="r").reshape(4, page)
    assert int(view.sum()) > 0  # faulted in
    copied = BlockArena(1 << 20).take(view)
    assert torch.equal(copied, torch.from_numpy(np.array(view)))  # re-read from the file


@pytest.mark.skipif(huge_pages_mode() is None, reason="this kernel has no transparent huge pages")
@pytest.mark.skipif(load_ggml_quant()[0] is None, reason=load_ggml_quant()[1])
def test_every_projection_computes_on_blocks_in_the_arena(random_file: Path, caplog) -> None:
    with caplog.at_level("INFO", logger="app.models.load.plan"):
        runner = load_on_blocks(random_file, wide_copies="off")
    assert "copied into 2 MiB pages" in caplog.text
    weights = runner.model.weights
    linears = [p for layer in weights.layers for p in (layer.qkv, layer.attn_output)]
    linears += [p for layer in weights.layers for p in (layer.gate_up, layer.down)]
    linears.append(weights.lm_head)
    assert all(isinstance(p, GGMLLinear) for p in linears)
    segments = [s.blocks for p in linears for s in p.segments]  # type: ignore[union-attr]
    anonymous = _anonymous_huge_ranges()
    assert all(any(lo <= t.data_ptr() < hi for lo, hi in anonymous) for t in segments)
    assert all(t.is_contiguous() and t.data_ptr() % ALIGN == 0 for t in segments)


@pytest.mark.skipif(load_ggml_quant()[0] is None, reason=load_ggml_quant()[1])
def test_without_huge_pages_the_blocks_stay_the_files_mapping(
    random_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setattr(block_arena_prefault, "THP_SETTING", tmp_path / "missing")
    with caplog.at_level("INFO", logger="app.models.load.plan"):
        runner = load_on_blocks(random_file, wide_copies="off")
    assert "copied into 2 MiB pages" not in caplog.text
    qkv = runner.model.weights.layers[0].attn_output
    assert isinstance(qkv, GGMLLinear)
    pointer = qkv.segments[0].blocks.data_ptr()
    assert any(lo <= pointer < hi for lo, hi in _file_ranges(random_file))


def _maps() -> list[tuple[int, int, str, str]]:
    """(start, end, the smaps block, the mapped path) of each mapping of this process."""
    out, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            current = [lo, hi, "", fields[5] if len(fields) > 5 else ""]
            out.append(current)
        elif current is not None:
            current[2] += line + "\n"
    return [tuple(m) for m in out]  # type: ignore[misc]


def _anonymous_huge_ranges() -> list[tuple[int, int]]:
    return [(lo, hi) for lo, hi, info, path in _maps() if not path and "hg" in _vm_flags(info)]


def _file_ranges(path: Path) -> list[tuple[int, int]]:
    return [(lo, hi) for lo, hi, _, mapped in _maps() if mapped == str(path)]


def _vm_flags(info: str) -> list[str]:
    for line in info.splitlines():
        if line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


def test_the_command_line_faults_the_arena_in_ahead_and_the_load_claims_it(
    random_file: Path, caplog
) -> None:
    if huge_pages_mode() is None or load_ggml_quant()[0] is None:
        pytest.skip("no transparent huge pages or no GGUF-block kernels here")
    assert block_arena_prefault.reserve(str(random_file))
    _join_fault_in_threads()
    with caplog.at_level("INFO", logger="app.models.load.plan"):
        ahead = load_on_blocks(random_file, wide_copies="off")
    assert "faulted in while the server imported" in caplog.text
    assert not block_arena_prefault._reserved  # claimed
    plain = load_on_blocks(random_file, wide_copies="off")
    for got, want in zip(_segments(ahead), _segments(plain), strict=True):
        assert torch.equal(got, want)


def test_the_fault_in_makes_the_whole_mapping_resident(
    random_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if huge_pages_mode() is None:
        pytest.skip("no transparent huge pages here")
    monkeypatch.setattr(block_arena_prefault, "POPULATE_CHUNK", block_arena_prefault.HUGE_PAGE)
    assert block_arena_prefault.reserve(str(random_file))
    _join_fault_in_threads()
    size = block_arena_prefault.arena_bytes(random_file.stat().st_size)
    mapping = block_arena_prefault.claim(random_file, size)
    assert mapping is not None and len(mapping) == size
    address = ctypes.addressof((ctypes.c_char * size).from_buffer(mapping))
    info = next(i for lo, hi, i, _ in _maps() if lo <= address < hi)
    rss_kib = int(next(line.split()[1] for line in info.splitlines() if line.startswith("Rss:")))
    assert rss_kib * 1024 >= size  # every page present before anything was copied


def test_the_fault_in_asks_the_kernel_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # one madvise over the whole arena held the process's mmap lock for its whole fault-in,
    # and the importing thread's dlopens waited for it (1.5 s of the 1B file's start)
    calls: list[tuple[int, int, int]] = []

    class Libc:
        def madvise(self, address: ctypes.c_void_p, length: ctypes.c_size_t, advice: int) -> int:
            calls.append((address.value or 0, length.value, advice))
            return 0

    monkeypatch.setattr(block_arena_prefault.ctypes, "CDLL", lambda *a, **k: Libc())
    chunk = block_arena_prefault.POPULATE_CHUNK
    size = 2 * chunk + block_arena_prefault.HUGE_PAGE
    mapping = block_arena_prefault.new_arena_mapping(size)
    block_arena_prefault._populate(mapping)
    base = ctypes.addressof((ctypes.c_char * size).from_buffer(mapping))
    assert calls == [
        (base, chunk, block_arena_prefault.MADV_POPULATE_WRITE),
        (base + chunk, chunk, block_arena_prefault.MADV_POPULATE_WRITE),
        (base + 2 * chunk, size - 2 * chunk, block_arena_prefault.MADV_POPULATE_WRITE),
    ]


def test_nothing_is_reserved_for_what_the_load_would_not_copy(
    random_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x08" + bytes(64))
    assert not block_arena_prefault.reserve(str(tmp_path / "model.safetensors"))  # not GGUF
    assert not block_arena_prefault.reserve(str(tmp_path / "missing.gguf"))
    assert not block_arena_prefault.reserve(str(tmp_path))  # a Hugging Face directory
    assert not block_arena_prefault.reserve("mock")
    monkeypatch.setattr(block_arena_prefault, "_available_bytes", lambda: 2 * 2**20)
    assert not block_arena_prefault.reserve(str(random_file))  # more than half the memory
    monkeypatch.undo()
    monkeypatch.setattr(block_arena_prefault, "THP_SETTING", tmp_path / "missing")
    assert not block_arena_prefault.reserve(str(random_file))
    assert not block_arena_prefault._reserved


def test_a_reservation_for_another_size_or_not_taken_is_released(random_file: Path) -> None:
    if huge_pages_mode() is None:
        pytest.skip("no transparent huge pages here")
    size = block_arena_prefault.arena_bytes(random_file.stat().st_size)
    assert block_arena_prefault.reserve(str(random_file))
    assert block_arena_prefault.claim(random_file, size + (2 << 20)) is None  # file rewritten
    assert block_arena_prefault.claim(random_file, size) is None  # handed over once at most
    assert block_arena_prefault.reserve(str(random_file))
    block_arena_prefault.release_unclaimed()
    assert not block_arena_prefault._reserved
    _join_fault_in_threads()


def _join_fault_in_threads() -> None:
    for thread in threading.enumerate():
        if thread.name == "block-arena-prefault":
            thread.join(timeout=60)


def _segments(runner) -> list[torch.Tensor]:
    weights = runner.model.weights
    linears = [p for layer in weights.layers for p in (layer.qkv, layer.down)]
    return [s.blocks for p in linears for s in p.segments]


def test_closing_gives_back_the_pages_past_the_last_matrix() -> None:
    arena = BlockArena(8 << 20, block_arena_prefault.new_arena_mapping(8 << 20))
    blocks = np.full((3, 1000), 7, dtype=np.uint8)
    kept = arena.take(blocks)
    arena._raw[arena.used :].fill_(1)  # resident, as a mapping faulted in ahead is
    before = _rss_kib(kept.data_ptr())
    arena.close()
    assert torch.equal(kept, torch.from_numpy(blocks))  # the matrix's page stays
    assert _rss_kib(kept.data_ptr()) <= before - 4 * 1024  # most of 8 MiB went back
    assert int(arena._raw[-1]) == 0  # (a page given back reads as zeros)


def _rss_kib(address: int) -> int:
    info = next(i for lo, hi, i, _ in _maps() if lo <= address < hi)
    return int(next(line.split()[1] for line in info.splitlines() if line.startswith("Rss:")))
