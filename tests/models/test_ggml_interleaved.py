"""Rows interleaved eight at a time ("x8", ``ggml_quant.h``): the 32-weight formats' blocks
repacked at load into the same bytes in another order, which every kernel reads as it reads
the file's rows. Each check is exact: the repacked matrix gives the file's outputs bit for bit
(the same integers and the same float sequence per output, so the tolerance of
``test_ggml_kernels`` against gguf's decoder carries over), on every instruction set this CPU
has, for the one-row gemv, the decoded tiles, the AMX tiles and the portable C, with a tail of
rows past the last full group."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from make_random_gguf import write_random_gguf

from app.models.kernels.ggml_quant import INTERLEAVED_TYPES, Isa, QuantSegment, load_ggml_quant
from app.models.load import plan
from app.models.weights import block_arena
from app.models.weights.block_arena import BlockArena, huge_pages_mode
from app.models.weights.ggml import GGMLLinear
from tests.models.stepping import load_on_blocks, sequence_logits
from tests.models.test_ggml_kernels import random_blocks

KERNELS, HOW = load_ggml_quant()
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"GGUF-block kernels: {HOW}")
ISAS = [isa for isa in Isa if KERNELS is not None and KERNELS.supports(isa)]
KINDS = sorted(INTERLEAVED_TYPES)


def repacked(kind: str, blocks: np.ndarray) -> QuantSegment:
    assert KERNELS is not None
    out = np.empty_like(blocks)
    KERNELS.repack8(kind, blocks, out)
    return QuantSegment(kind, torch.from_numpy(out), interleaved=True)


@pytest.mark.parametrize("kind", KINDS)
def test_the_repack_moves_every_byte_and_rows_decode_as_the_files(kind: str) -> None:
    """Full groups change order (nothing is lost: the bytes are a permutation of each group's),
    the tail stays; every row decodes as the file's row does."""
    columns = 768 if kind.endswith("_K") else 608
    blocks = random_blocks(kind, 21, columns, seed=1)
    segment = repacked(kind, blocks)
    out = segment.blocks.numpy()
    assert not np.array_equal(out[:16], blocks[:16])
    for group in (0, 8):
        # the same bits (Q5's qh words are bit-transposed: test_q5_fifth_bits_are_transposed)
        assert np.unpackbits(out[group : group + 8]).sum() == (
            np.unpackbits(blocks[group : group + 8]).sum()
        )
        if not kind.startswith("Q5"):
            assert np.array_equal(
                np.sort(out[group : group + 8], axis=None),
                np.sort(blocks[group : group + 8], axis=None),
            )
    assert np.array_equal(out[16:], blocks[16:])  # rows past the last full group
    file = QuantSegment(kind, torch.from_numpy(blocks))
    ids = torch.tensor([0, 7, 8, 15, 16, 20, 3])
    for dtype in (torch.float32, torch.bfloat16):
        got = KERNELS.dequantize_rows(segment, columns, ids, dtype)  # type: ignore[union-attr]
        assert torch.equal(got, KERNELS.dequantize_rows(file, columns, ids, dtype))  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="outside its 21 rows"):
        KERNELS.dequantize_rows(segment, columns, torch.tensor([21]), torch.float32)  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_q5_fifth_bits_are_transposed(kind: str) -> None:
    """The x8 qh chunk of a Q5 block (ggml_quant.h): byte 4j + t holds at bit v the fifth bit
    of weight 4v + t of row j, so a tile group's fifth bits are one shift and one mask away."""
    block_bytes, qh_at, x8_qh_at = (22, 2, 16) if kind == "Q5_0" else (24, 4, 32)
    blocks = random_blocks(kind, 8, 64, seed=3)
    out = repacked(kind, blocks).blocks.numpy()
    for b in range(2):  # the two blocks of each row
        at = b * block_bytes + qh_at
        qh = blocks[:, at : at + 4].copy().view("<u4")[:, 0]
        x8 = out.reshape(-1)[b * 8 * block_bytes + x8_qh_at :][:32]
        want = [
            sum(((int(qh[j]) >> (4 * v + t)) & 1) << v for v in range(8))
            for j in range(8)
            for t in range(4)
        ]
        assert x8.tolist() == want


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.name.lower())
@pytest.mark.parametrize("kind", KINDS)
def test_every_kernel_gives_the_files_bits_on_interleaved_rows(kind: str, isa: Isa) -> None:
    """1-100 activation rows (the gemv of one row and of several, the 512-bit units of 16 rows
    with AVX-512, the decoded tiles, AMX from 16 rows where the CPU has it: Q8_0's codes read in
    place, the other formats' next unit decoded between a unit's products; Q4_0 and Q4_1 at 24
    rows with VNNI and past 64 on AVX2, Q4_K past 16 on AVX2: the x8 gemv against the file's
    decoded tile), 37 weight rows (two full units, then a 5-row tail), 24 (a unit of one group)
    and 64 (four full units), two widths, activations at the codes' extremes, a bias and a
    bfloat16 residual."""
    assert KERNELS is not None
    generator = torch.Generator().manual_seed(7)
    widths = (256, 256, 768) if kind.endswith("_K") else (96, 96, 608)
    for columns, n in zip(widths, (37, 24, 64), strict=True):
        blocks = random_blocks(kind, n, columns, seed=n)
        file, x8 = QuantSegment(kind, torch.from_numpy(blocks)), repacked(kind, blocks)
        x = torch.randn(100, columns, generator=generator)
        x[2] = torch.where(x[2] > 0, 1e3, -1e3)  # every activation byte at +-127
        for rows in (1, 2, 3, 7, 12, 16, 24, 33, 64, 65, 100):
            want = KERNELS.matmul((file,), x[:rows], isa=isa)
            got = KERNELS.matmul((x8,), x[:rows], isa=isa)
            assert torch.equal(got, want), f"{kind} {isa.name} {n}x{columns}, {rows} rows"
        bias = torch.randn(n, generator=generator)
        residual = torch.randn(5, n, generator=generator).to(torch.bfloat16)
        xb = x[:5].to(torch.bfloat16)
        want = KERNELS.matmul((file,), xb, bias=bias, residual=residual, isa=isa)
        got = KERNELS.matmul((x8,), xb, bias=bias, residual=residual, isa=isa)
        assert torch.equal(got, want), f"{kind} {isa.name} with a bias and a residual"


@pytest.mark.skipif(Isa.AVX512 not in ISAS, reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("kind", [k for k in KINDS if not k.endswith("_K")])
def test_the_512_bit_units_give_the_256_bit_kernels_bits(kind: str) -> None:
    """AVX-512 computes a unit of 16 interleaved rows in 512-bit vectors (both groups side by
    side, ``ggml_quant_tiles16.h``) from 2 activation rows (Q8_0 from 4); AVX2 in 256-bit ones,
    a group at a time. The same integers and float sequence per lane, so the same bits: 2-100
    rows (a run of eight and its remainder), three full units and a 5-row tail, codes and
    activations at their extremes, a bias and a bfloat16 residual."""
    assert KERNELS is not None
    blocks = random_blocks(kind, 53, 608, seed=5)
    blocks_max = blocks.reshape(53, 608 // 32, -1).copy()  # every code at its largest magnitude
    codes_at = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4, "Q8_0": 2}[kind]  # (qh too)
    blocks_max[:, :, codes_at:] = 0x80 if kind == "Q8_0" else 0xFF  # Q8_0: -128
    blocks_max = blocks_max.reshape(53, -1)
    x8, x8_max = repacked(kind, blocks), repacked(kind, blocks_max)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(100, 608, generator=generator)
    x[1] = torch.where(x[1] > 0, 1e3, -1e3)  # every activation byte at +-127
    for rows in (2, 3, 4, 5, 8, 9, 16, 17, 64, 100):
        for segment in (x8, x8_max):
            wide = KERNELS.matmul((segment,), x[:rows], isa=Isa.AVX512)
            narrow = KERNELS.matmul((segment,), x[:rows], isa=Isa.AVX2)
            assert torch.equal(wide, narrow), f"{kind}, {rows} rows"
    bias = torch.randn(53, generator=generator)
    residual = torch.randn(6, 53, generator=generator).to(torch.bfloat16)
    xb = x[:6].to(torch.bfloat16)
    wide = KERNELS.matmul((x8,), xb, bias=bias, residual=residual, isa=Isa.AVX512)
    narrow = KERNELS.matmul((x8,), xb, bias=bias, residual=residual, isa=Isa.AVX2)
    assert torch.equal(wide, narrow), f"{kind} with a bias and a residual"


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa >= Isa.AVX2], ids=lambda isa: isa.name.lower())
def test_the_vector_epilogues_store_the_scalar_bits(isa: Isa) -> None:
    """The epilogue (bias, residual, the one rounding to bfloat16) stores 16 outputs at a time
    on AVX-512, 8 on AVX2 and one in the portable C: the same bits. Zero weights make every
    instruction set's sums exactly 0, so the outputs are the epilogue's alone: a bias of NaNs
    with payloads (a signalling one too), infinities, rounding ties to even (both ways), a
    denormal and large values, a residual with infinities; 45 rows are two units of 16, a full
    group of 8 and a 5-row tail, so every width runs."""
    assert KERNELS is not None
    n, columns = 45, 64
    zeros = QuantSegment("Q8_0", torch.zeros(n, columns // 32 * 34, dtype=torch.uint8))
    segment = repacked("Q8_0", zeros.blocks.numpy())
    generator = torch.Generator().manual_seed(21)
    patterns = np.array(
        [0x7FA12345, 0x7FC00001, 0xFF812345, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0x3F808000, 0x3F818000,
         0x3F808001, 0x00000001, 0x7F7FFFFF, 0xC2F7FFFF, 0x80000000],
        dtype=np.uint32,
    )
    bias = torch.randn(n, generator=generator) * 100
    bias[: len(patterns)] = torch.from_numpy(patterns.view(np.float32).copy())
    bias[16 : 16 + len(patterns)] = bias[: len(patterns)].flip(0)
    bias[32:] = bias[: n - 32]
    residual = torch.randn(7, n, generator=generator).to(torch.bfloat16)
    residual[3, ::5] = float("inf")
    residual[4, 1::7] = float("-inf")
    x = torch.randn(7, columns, generator=generator).to(torch.bfloat16)
    for rows in (1, 2, 7):
        for res in (None, residual[:rows]):
            want = KERNELS.matmul((zeros,), x[:rows], bias=bias, residual=res, isa=Isa.SCALAR)
            for seg in (zeros, segment):
                got = KERNELS.matmul((seg,), x[:rows], bias=bias, residual=res, isa=isa)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rows, res is None)
    wide = KERNELS.matmul((segment,), x.float(), bias=bias, isa=isa)  # float32 outputs
    scalar = KERNELS.matmul((zeros,), x.float(), bias=bias, isa=Isa.SCALAR)
    assert torch.equal(wide.view(torch.int32), scalar.view(torch.int32))


def test_segments_of_both_layouts_in_one_call() -> None:
    """A fused projection (a Q4_K_M file's QKV) whose segments are interleaved, in the file's
    layout, and of a type without an x8 layout (Q6_K) computes each as alone."""
    assert KERNELS is not None
    parts = (
        repacked("Q4_K", random_blocks("Q4_K", 24, 512, 1)),
        QuantSegment("Q8_0", torch.from_numpy(random_blocks("Q8_0", 16, 512, 2))),
        QuantSegment("Q6_K", torch.from_numpy(random_blocks("Q6_K", 16, 512, 3))),
    )
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    together = GGMLLinear(KERNELS, parts, 512)(x)
    alone = torch.cat([KERNELS.matmul((s,), x) for s in parts], dim=1)
    assert torch.equal(together, alone)


def test_the_arena_repacks_a_matrix_in_parts_of_whole_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert KERNELS is not None
    monkeypatch.setattr(block_arena, "COPY_BYTES", 700)  # 35 rows of 20 bytes -> parts of 40
    blocks = random_blocks("Q4_1", 101, 32, seed=4)
    whole = repacked("Q4_1", blocks).blocks
    got = BlockArena(1 << 20).take(blocks, lambda part, out: KERNELS.repack8("Q4_1", part, out))
    assert torch.equal(got, whole)
    with pytest.raises(ValueError, match="not repacked here"):
        KERNELS.repack8("Q6_K", random_blocks("Q6_K", 8, 256, 1), np.empty((8, 210), np.uint8))


@pytest.mark.skipif(huge_pages_mode() is None, reason="no transparent huge pages: no arena")
@pytest.mark.parametrize("types", ["Q4_1,Q5_0,Q8_0", "Q4_K,Q6_K,Q4_0", "Q5_K,Q5_1,Q6_K"])
def test_a_model_loads_interleaved_and_computes_the_files_logits(
    types: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default load repacks every matrix of a type with the layout (projections and the
    tied head and embedding) as it copies it, and no other (Q5_K, Q6_K); SLOTSERVE_GGML_REPACK=0's
    load keeps the file's layout. Prompt chunk and decode logits are the same bits."""
    assert KERNELS is not None and KERNELS.isa >= Isa.AVX2
    shape = {"hidden": 256, "ffn": 512, "layers": 2, "heads": 4, "kv_heads": 2}
    path = write_random_gguf(tmp_path / "model.gguf", types=types, **shape)
    x8 = load_on_blocks(path, wide_copies="off")
    monkeypatch.setattr(
        plan, "load_ggml_quant", lambda: (dataclasses.replace(KERNELS, repack=False), HOW)
    )
    file = load_on_blocks(path, wide_copies="off")
    kinds = {s.tensor_type for s in _segments(x8)}
    assert kinds == set(types.split(","))
    assert all(s.interleaved == (s.tensor_type in KINDS) for s in _segments(x8))
    assert not any(s.interleaved for s in _segments(file))
    tokens = [1, 17, 400, 9000, 33, 2, 5000, 12, 7, 7, 300]
    want = sequence_logits(file.model, tokens, chunk=5)
    assert torch.equal(sequence_logits(x8.model, tokens, chunk=5), want)


def _segments(runner) -> list[QuantSegment]:
    weights = runner.model.weights
    linears = [p for layer in weights.layers for p in (layer.qkv, layer.attn_output)]
    linears += [p for layer in weights.layers for p in (layer.gate_up, layer.down)]
    linears.append(weights.lm_head)
    assert all(isinstance(p, GGMLLinear) for p in linears)
    return [s for p in linears for s in p.segments]


def test_the_repack_follows_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLOTSERVE_GGML_REPACK=0 keeps the file's layout (said in the kernels' description, which
    the start-up log and /info show); unset, the SIMD kernels repack."""
    try:
        monkeypatch.setenv("SLOTSERVE_GGML_REPACK", "0")
        load_ggml_quant.cache_clear()
        kernels, how = load_ggml_quant()
        assert kernels is not None and not kernels.repack
        assert not kernels.interleaves("Q4_1", 64)
        assert "rows in the file's layout (SLOTSERVE_GGML_REPACK=0)" in how
        monkeypatch.delenv("SLOTSERVE_GGML_REPACK")
        load_ggml_quant.cache_clear()
        kernels, how = load_ggml_quant()
        assert kernels is not None and kernels.repack
        simd = kernels.isa >= Isa.AVX2  # the portable C keeps the file's layout
        assert kernels.interleaves("Q4_K", 8) == simd and not kernels.interleaves("Q4_K", 7)
        assert not kernels.interleaves("Q6_K", 64)
        assert ("Q4_0-Q8_0 and Q4_K rows interleaved 8 at a time at load" in how) == simd
    finally:
        monkeypatch.delenv("SLOTSERVE_GGML_REPACK", raising=False)
        load_ggml_quant.cache_clear()
        load_ggml_quant()  # the process's default again, for the tests after this one
