"""The GGUF-block kernels (app/models/kernels/ggml_quant*.c) against gguf's own decoder.

For every format and every instruction set this CPU has: random blocks (random codes, sane
fp16 scales) times random activations, against the float64 product of
``gguf.quants.dequantize(W)`` with ``x``. The kernels quantise ``x`` to 8-bit blocks (one
scale ``d = amax / 127`` per block of 32 or 256 values), so each activation is off by at most
``d / 2``; the tolerance of an output is that bound summed with its weights,
``sum_blocks d_b / 2 * sum_{j in b} |w_j|``, plus float32 rounding of the sum (1e-5 of
``sum |w| |x|``). Rows 1, 2, 3, 7, 16, 33 and 64; odd output counts and widths where the
format allows (32-weight formats at 96 and 608 columns).
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch
from bench_kernels_ab import random_blocks  # random codes, sane fp16 scales (scripts/)

from app.models.kernels.ggml_quant import (
    AMX_MIN_ROWS,
    KERNEL_TYPES,
    Isa,
    QuantSegment,
    load_ggml_quant,
)
from app.models.weights.ggml import GGMLEmbedding, GGMLLinear

KERNELS, HOW = load_ggml_quant()
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"GGUF-block kernels: {HOW}")

ISAS = [isa for isa in Isa if KERNELS is not None and KERNELS.supports(isa)]
ROWS = (1, 2, 3, 7, 16, 33, 64)
WIDTHS = {kind: (256, 768) if kind.endswith("_K") else (96, 608) for kind in KERNEL_TYPES}


def dequantized(kind: str, blocks: np.ndarray, columns: int) -> np.ndarray:
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
    return np.asarray(values, dtype=np.float64).reshape(blocks.shape[0], columns)


def tolerance(kind: str, weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``[M, N]``: the activation quantisation's bound plus float32 rounding (module doc)."""
    block = 256 if kind.endswith("_K") else 32
    rows, columns = x.shape
    amax = np.abs(x).reshape(rows, columns // block, block).max(axis=-1)  # [M, blocks]
    w_abs = np.abs(weights).reshape(weights.shape[0], columns // block, block).sum(-1)
    bound = (amax / 127.0 / 2.0) @ w_abs.T  # [M, N]
    return bound * 1.001 + 1e-5 * (np.abs(x) @ np.abs(weights).T) + 1e-6


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.name.lower())
@pytest.mark.parametrize("kind", sorted(KERNEL_TYPES))
def test_every_format_on_every_instruction_set_matches_gguf_dequantize(kind: str, isa: Isa) -> None:
    assert KERNELS is not None
    for width_index, columns in enumerate(WIDTHS[kind]):
        n = 37 if width_index == 0 else 64
        blocks = random_blocks(kind, n, columns, seed=width_index)
        weights = dequantized(kind, blocks, columns)
        segment = QuantSegment(kind, torch.from_numpy(blocks))
        generator = torch.Generator().manual_seed(width_index)
        x = torch.randn(max(ROWS), columns, generator=generator)
        x[0, :32] = 0.0  # a block of zeros (d = 0)
        x[1] *= 100.0  # a large row
        expected = x.double().numpy() @ weights.T
        bound = tolerance(kind, weights, x.double().numpy())
        alone = torch.cat([KERNELS.matmul((segment,), x[i : i + 1], isa=isa) for i in range(64)])
        for rows in ROWS:
            got = KERNELS.matmul((segment,), x[:rows], isa=isa)
            error = np.abs(got.double().numpy() - expected[:rows])
            worst = (error / bound[:rows]).max()
            assert worst <= 1.0, f"{kind} {isa.name} {rows}x{columns}: {worst:.3f} of the bound"
            # batch invariance: every row as it comes out alone
            assert torch.equal(got, alone[:rows]), f"{kind} {isa.name}: rows depend on the batch"


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.name.lower())
def test_every_instruction_set_agrees_with_the_scalar_path(isa: Isa) -> None:
    """The same products as the portable C, rows of magnitudes 1e-3 to 1e3: the SIMD paths
    quantise the activations to the same bytes (the same rounding, in float32) and differ only
    in the order of the float32 sum over blocks."""
    assert KERNELS is not None
    columns = 512
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(5, columns, generator=generator) * torch.logspace(-3, 3, 5)[:, None]
    for kind in ("Q8_0", "Q4_K", "Q6_K", "Q5_1"):
        segment = QuantSegment(kind, torch.from_numpy(random_blocks(kind, 24, columns, 4)))
        scalar = KERNELS.matmul((segment,), x, isa=Isa.SCALAR).double()
        simd = KERNELS.matmul((segment,), x, isa=isa).double()
        scale = scalar.abs().amax(dim=1, keepdim=True)
        assert ((simd - scalar).abs() <= 1e-5 * scale + 1e-30).all(), kind


TILE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.skipif(Isa.AVX512 not in ISAS, reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("kind", TILE_TYPES)
def test_the_tile_kernels_give_the_same_bits_with_vnni_as_with_avx2(kind: str) -> None:
    """The tiles sum their integers with vpdpbusd on AVX-512 VNNI and with vpmaddubsw pairs on
    AVX2: exact either way, then one float sequence, so every output is the same bit for bit (a
    model served on either CPU kind decodes the same tokens), one row (the gemv) or many (the
    decoded tile), a tail tile of 5 rows included, codes at their extremes."""
    assert KERNELS is not None
    columns, n = (768 if kind.endswith("_K") else 608), 21
    blocks = random_blocks(kind, n, columns, seed=11)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(64, columns, generator=generator)
    x[2] = torch.where(x[2] > 0, 1e3, -1e3)  # every activation byte at +-127
    segment = QuantSegment(kind, torch.from_numpy(blocks))
    for rows in (1, 3, 4, 9, 64):
        avx2 = KERNELS.matmul((segment,), x[:rows], isa=Isa.AVX2)
        vnni = KERNELS.matmul((segment,), x[:rows], isa=Isa.AVX512)
        assert torch.equal(avx2, vnni), f"{kind}, {rows} rows"


AMX_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


@pytest.mark.skipif(KERNELS is None or not KERNELS.amx, reason="no AMX-INT8 here (or turned off)")
@pytest.mark.parametrize("kind", AMX_TYPES)
def test_the_amx_tiles_give_the_same_bits_as_avx2(kind: str) -> None:
    """From AMX_MIN_ROWS activation rows the 32-weight formats run on AMX-INT8 tiles (16 weight
    rows x up to 16 activation rows a block): the same exact integers and float sequence as the
    AVX2 tiles, so the same bits; groups of 16 activation rows with a tail, two units of 16
    weight rows with a tail, a bias and a residual rounded to bfloat16."""
    assert KERNELS is not None
    columns, n = 608, 37
    blocks = random_blocks(kind, n, columns, seed=5)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(40, columns, generator=generator)
    x[1] = torch.where(x[1] > 0, 1e3, -1e3)  # every activation byte at +-127
    segment = QuantSegment(kind, torch.from_numpy(blocks))
    for rows in (AMX_MIN_ROWS, 16, 17, 33, 40):
        avx2 = KERNELS.matmul((segment,), x[:rows], isa=Isa.AVX2)
        amx = KERNELS.matmul((segment,), x[:rows], isa=Isa.AVX512)
        assert torch.equal(avx2, amx), f"{kind}, {rows} rows"
    bias = torch.randn(n, generator=generator)
    residual = torch.randn(33, n, generator=generator).to(torch.bfloat16)
    xb = x[:33].to(torch.bfloat16)
    avx2 = KERNELS.matmul((segment,), xb, bias=bias, residual=residual, isa=Isa.AVX2)
    amx = KERNELS.matmul((segment,), xb, bias=bias, residual=residual, isa=Isa.AVX512)
    assert torch.equal(avx2, amx), kind


def test_segments_bias_residual_and_bfloat16_rounding() -> None:
    """A Q4_K_M-style fused QKV (Q4_K, Q4_K, Q6_K rows), with a bias and a residual, in
    bfloat16: the float32 result plus both, rounded once."""
    assert KERNELS is not None
    columns = 512
    parts = [("Q4_K", 40), ("Q4_K", 24), ("Q6_K", 24)]
    segments = tuple(
        QuantSegment(kind, torch.from_numpy(random_blocks(kind, rows, columns, seed)))
        for seed, (kind, rows) in enumerate(parts)
    )
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(9, columns, generator=generator).to(torch.bfloat16)
    residual = torch.randn(9, 88, generator=generator).to(torch.bfloat16)
    bias = torch.randn(88, generator=generator)
    linear = GGMLLinear(KERNELS, segments, columns, bias)
    assert linear.out_features == 88 and linear.tensor_types == ("Q4_K", "Q4_K", "Q6_K")
    wide = torch.cat([KERNELS.matmul((s,), x.float()) for s in segments], dim=1)
    expected = (wide + bias + residual.float()).to(torch.bfloat16)
    assert torch.equal(linear.add_to(residual, x), expected)
    assert torch.equal(linear(x), (wide + bias).to(torch.bfloat16))
    assert torch.equal(KERNELS.matmul(segments, x[:0]), torch.empty(0, 88, dtype=torch.bfloat16))


def _bf16_rule(values: np.ndarray) -> np.ndarray:
    """The epilogue's rounding of float32 ``values`` to bfloat16 bits (ggml_quant.h,
    sl_fp32_to_bf16): to nearest, ties to even; a NaN keeps its high half, made quiet."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.name.lower())
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K"])
def test_the_bfloat16_epilogue_rounds_ties_to_even_and_keeps_nans(kind: str, isa: Isa) -> None:
    """Outputs of exactly 0 (zero activations) plus a bias whose bits are ties (both parities),
    NaNs, infinities and the largest float, with and without a residual: each stored value is
    the rule's, in the full groups of eight rows (sl_store8_avx2 where the instruction set has
    AVX2) and in the tail (27 rows: the scalar loop). Two NaNs tell the NaN rule from plain
    rounding (0x7FFFFFFF would round to -0, 0x7FC18000 to 0x7FC2). A float32 result is the
    float sums, unrounded."""
    assert KERNELS is not None
    rows, columns = 27, WIDTHS[kind][0]
    segment = QuantSegment(kind, torch.from_numpy(random_blocks(kind, rows, columns, seed=4)))
    rng = np.random.default_rng(5)
    ties = [0x3F808000, 0x3F818000, 0xBF808000]  # 1.00391 (even), 1.01172 (odd), -1.00391
    nans = [0x7FFFFFFF, 0x7FC18000, 0x7FC00000, 0xFFA00000]  # the last: signalling, negative
    others = [0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x0000FFFF]  # +-inf, max, a denormal
    special = ties + nans + others
    raw = rng.integers(0, 2**32, rows, dtype=np.uint64)
    raw[: len(special)] = special
    raw[len(special) :: 2] = (raw[len(special) :: 2] & 0xFFFF0000) | 0x8000  # more ties
    raw[-3:] = [0x7FFFFFFF, 0x3F818000, 0xFF800000]  # in the tail too
    bias_values = raw.astype(np.uint32).view(np.float32)
    bias = torch.from_numpy(bias_values.copy())
    x = torch.zeros(3, columns, dtype=torch.bfloat16)

    def stored(residual: torch.Tensor | None, out_dtype: torch.dtype) -> np.ndarray:
        y = KERNELS.matmul(
            (segment,), x, bias=bias, residual=residual, isa=isa, out_dtype=out_dtype
        )
        return y.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32).numpy()

    with np.errstate(invalid="ignore", over="ignore"):  # NaN and infinity are the point
        outputs = np.float32(0.0) + bias_values
        residual = torch.randn(3, rows, generator=torch.Generator().manual_seed(6))
        summed = outputs[None, :] + residual.to(torch.bfloat16).float().numpy()
        summed32 = outputs[None, :] + residual.numpy()
    got = stored(None, torch.bfloat16).view(np.uint16)
    assert np.array_equal(got, np.broadcast_to(_bf16_rule(outputs), got.shape))
    got = stored(residual.to(torch.bfloat16), torch.bfloat16).view(np.uint16)
    assert np.array_equal(got, _bf16_rule(summed))
    got = stored(residual, torch.float32).view(np.uint32)
    assert np.array_equal(got, summed32.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("kind", sorted(KERNEL_TYPES))
def test_token_lookups_decode_as_gguf_does(kind: str) -> None:
    assert KERNELS is not None
    columns = WIDTHS[kind][0]
    blocks = random_blocks(kind, 50, columns, seed=3)
    segment = QuantSegment(kind, torch.from_numpy(blocks))
    ids = torch.tensor([7, 0, 49, 7])
    expected = dequantized(kind, blocks, columns)[ids.numpy()]
    lookup = GGMLEmbedding(KERNELS, segment, columns, torch.float32)
    np.testing.assert_array_equal(lookup(ids).double().numpy(), expected)
    bf16 = GGMLEmbedding(KERNELS, segment, columns, torch.bfloat16)(ids)
    assert torch.equal(bf16, torch.from_numpy(expected).float().to(torch.bfloat16))


def test_a_row_is_the_same_on_one_thread_and_on_all() -> None:
    assert KERNELS is not None
    columns = 768
    segment = QuantSegment("Q5_K", torch.from_numpy(random_blocks("Q5_K", 100, columns, 5)))
    x = torch.randn(20, columns, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    together = KERNELS.matmul((segment,), x)
    torch.set_num_threads(1)
    try:
        alone = KERNELS.matmul((segment,), x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q8_0"])
def test_tiles_taken_over_by_another_thread_give_the_same_bits(kind: str) -> None:
    """Work stealing (sl_tile_claim): with more threads than cores, some start late and the
    others take the last tiles of their runs; every output is the bits of one thread alone."""
    assert KERNELS is not None
    columns = 256 if kind.endswith("_K") else 576
    blocks = random_blocks(kind, 1024, columns, 11)
    interleaved = np.empty_like(blocks)
    KERNELS.repack8(kind, blocks, interleaved)
    segment = QuantSegment(kind, torch.from_numpy(interleaved), interleaved=True)
    x = torch.randn(16, columns, generator=torch.Generator().manual_seed(11))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = KERNELS.matmul((segment,), x)
        torch.set_num_threads(8)
        before = KERNELS.tiles_taken_over
        for _ in range(200):
            assert torch.equal(KERNELS.matmul((segment,), x), alone)
            if KERNELS.tiles_taken_over > before:
                break
    finally:
        torch.set_num_threads(threads)
    assert KERNELS.tiles_taken_over > before, "no tile was taken over in 200 calls"
    assert torch.equal(KERNELS.matmul((segment,), x[:1]), alone[:1])  # (one row: static runs)


@pytest.mark.skipif(KERNELS is None, reason=HOW)
def test_the_prefetch_level_is_l2_for_narrow_calls_unless_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tile kernels prefetch the next rows into L2 for calls of up to 32 activation rows
    on Intel CPUs and 64 elsewhere, into L1 for wider ones; SLOTSERVE_GGML_PREFETCH=l1 puts
    every call's into L1, l2 is the default, anything else leaves the kernels unloaded with
    its name in the reason. Where the rows go changes no output."""
    assert KERNELS is not None
    limit = ctypes.c_int64.in_dll(KERNELS.library, "sl_prefetch_l2_rows")
    now = ctypes.c_int.in_dll(KERNELS.library, "sl_prefetch_l2_now")
    intel = bool(KERNELS.library.sl_quant_cpu_is_intel())
    assert intel == ("GenuineIntel" in open("/proc/cpuinfo").read())
    width = 32 if intel else 64
    segment = QuantSegment("Q4_1", torch.from_numpy(random_blocks("Q4_1", 37, 608, seed=3)))
    x = torch.randn(9, 608, generator=torch.Generator().manual_seed(3))
    outputs = []
    try:
        for setting, rows in (("l1", 0), ("l2", width)):
            monkeypatch.setenv("SLOTSERVE_GGML_PREFETCH", setting)
            load_ggml_quant.cache_clear()
            _, how = load_ggml_quant()
            assert f"prefetch into L{1 + bool(rows)}" in how and "(SLOTSERVE_GGML_PREFETCH)" in how
            assert limit.value == rows
            outputs.append([KERNELS.matmul((segment,), x[:n]) for n in (1, 9)])
            assert now.value == bool(rows)  # a narrow call prefetches into L2 unless l1 is set
            KERNELS.matmul((segment,), torch.randn(width, 608))
            assert now.value == bool(rows)
            KERNELS.matmul((segment,), torch.randn(width + 1, 608))
            assert now.value == 0  # wider calls into L1
        assert all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))
        monkeypatch.setenv("SLOTSERVE_GGML_PREFETCH", "L3")
        load_ggml_quant.cache_clear()
        assert load_ggml_quant() == (None, "SLOTSERVE_GGML_PREFETCH='l3': expected l1 or l2")
        monkeypatch.delenv("SLOTSERVE_GGML_PREFETCH")
        load_ggml_quant.cache_clear()
        vendor = "an Intel CPU" if intel else "not Intel"
        assert f"prefetch into L2 up to {width} rows, L1 wider ({vendor})" in load_ggml_quant()[1]
        assert limit.value == width
    finally:
        monkeypatch.delenv("SLOTSERVE_GGML_PREFETCH", raising=False)
        load_ggml_quant.cache_clear()
        load_ggml_quant()  # the process's default again, for the tests after this one


@pytest.mark.parametrize("library", ["ggml_quant", "fused_decode"])
def test_the_c_compiles_without_openmp(library: str) -> None:
    """build.py builds without ``-fopenmp`` where torch has no libgomp: every source must then
    compile with its OpenMP calls guarded (found: the work stealing called
    ``omp_get_thread_num`` unguarded, an implicit declaration, an error in GCC 14, and an
    undefined symbol at load before it)."""
    import subprocess

    from app.models.kernels import fused_decode, ggml_quant
    from app.models.kernels.build import _compiler

    module = ggml_quant if library == "ggml_quant" else fused_decode
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    for source in (s for s in module.SOURCES if s.endswith(".c")):
        result = subprocess.run(
            [compiler, "-std=c11", *module.CFLAGS, "-fsyntax-only"]
            + ["-Werror=implicit-function-declaration", str(module.SOURCE_DIR / source)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, (source, result.stderr[-2000:])
