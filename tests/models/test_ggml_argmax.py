"""The LM head's argmax on the blocks (``GGMLKernels.argmax``, ``sl_quant_argmax``): the index
``torch.argmax`` gives on :meth:`GGMLKernels.matmul`'s float32 outputs, computed without storing
them, exactly (the same sums; torch's order: the first of equal values, a NaN above everything,
a row of -inf at 0), on every format, layout and instruction set this CPU has, with the columns
split over one thread and over two."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.models.kernels.ggml_quant import INTERLEAVED_TYPES, KERNEL_TYPES, Isa, QuantSegment
from app.models.weights import ggml
from app.models.weights.ggml import GGMLLinear, logits_in_thread_buffer
from tests.models.test_ggml_kernels import HOW, ISAS, KERNELS, random_blocks

pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"GGUF-block kernels: {HOW}")
# 1 row (the gemv), 2-16 (the gemv of several rows, decoded tiles, AMX from 12 or 16), 33 and 64
ROWS = (1, 2, 3, 7, 12, 16, 33, 64)
# 19 units of 16 weight rows, the last one short: both threads get columns
WEIGHT_ROWS = 300


def segments(kind: str) -> list[QuantSegment]:
    """``kind``'s random matrix in the file's layout and, where it has one, interleaved."""
    assert KERNELS is not None
    blocks = random_blocks(kind, WEIGHT_ROWS, 256, seed=len(kind))
    layouts = [QuantSegment(kind, torch.from_numpy(blocks))]
    if kind in INTERLEAVED_TYPES:
        out = np.empty_like(blocks)
        KERNELS.repack8(kind, blocks, out)
        layouts.append(QuantSegment(kind, torch.from_numpy(out), interleaved=True))
    return layouts


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.name.lower())
@pytest.mark.parametrize("kind", sorted(KERNEL_TYPES))
def test_the_argmax_is_torchs_on_the_matmuls_outputs(kind: str, isa: Isa, threads: int) -> None:
    assert KERNELS is not None
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=generator)
    bias = torch.randn(WEIGHT_ROWS, generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for segment in segments(kind):
            for rows in ROWS:
                for dtype, with_bias in ((torch.float32, None), (torch.bfloat16, bias)):
                    xs = x[:rows].to(dtype)
                    want = KERNELS.matmul(
                        (segment,), xs, bias=with_bias, out_dtype=torch.float32, isa=isa
                    )
                    got = KERNELS.argmax((segment,), xs, bias=with_bias, isa=isa)
                    assert got.dtype == torch.int64
                    assert torch.equal(got, want.argmax(dim=-1)), (
                        f"{kind} {isa.name} interleaved={segment.interleaved} {rows} rows"
                    )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", (1, 2))
def test_ties_nans_and_infinities_follow_torchs_argmax(threads: int) -> None:
    """Zero weights make every output its bias exactly, so the bias writes the cases: equal
    maxima in both threads' columns (the first wins), NaNs (the first NaN wins over anything),
    a row of -inf (index 0), +inf beside a NaN."""
    assert KERNELS is not None
    zeros = QuantSegment("Q8_0", torch.zeros((WEIGHT_ROWS, 34 * 8), dtype=torch.uint8))
    inf, nan = float("inf"), float("nan")
    cases = []
    tie = torch.full((WEIGHT_ROWS,), -1.0)
    tie[[7, 150, 290]] = 3.0
    cases.append(tie)
    late_tie = torch.full((WEIGHT_ROWS,), -1.0)
    late_tie[[200, 260]] = 3.0  # both in the second thread's columns
    cases.append(late_tie)
    nans = torch.randn(WEIGHT_ROWS, generator=torch.Generator().manual_seed(1))
    nans[[180, 40, 250]] = nan
    nans[10] = inf
    cases.append(nans)
    cases.append(torch.full((WEIGHT_ROWS,), -inf))
    one_nan = torch.full((WEIGHT_ROWS,), -inf)
    one_nan[170] = nan
    cases.append(one_nan)
    infinite = torch.full((WEIGHT_ROWS,), -inf)
    infinite[[99, 230]] = inf
    cases.append(infinite)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for bias in cases:
            for rows in (1, 5, 16):
                x = torch.randn(rows, 256)
                want = KERNELS.matmul((zeros,), x, bias=bias)
                assert torch.allclose(want, bias.expand(rows, -1), rtol=0, atol=0, equal_nan=True)
                got = KERNELS.argmax((zeros,), x, bias=bias)
                assert torch.equal(got, want.argmax(dim=-1)), (bias, got)
    finally:
        torch.set_num_threads(before)


def scaled_rows(scales: list[float], columns: int = 256) -> np.ndarray:
    """Q8_0 rows in the file's layout whose codes are all 1 and whose scale (every block's) is
    ``scales[row]``: with positive activations a row's output follows its scale, so equal
    scales give equal outputs, a NaN scale a NaN and an infinite one an infinity."""
    blocks = np.zeros((len(scales), columns // 32, 34), dtype=np.uint8)
    blocks[:, :, 0:2] = np.array(scales, dtype=np.float16).view(np.uint8).reshape(-1, 1, 2)
    blocks[:, :, 2:] = 1
    return blocks.reshape(len(scales), -1)


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.name.lower())
def test_ties_nans_and_infinities_in_the_outputs_follow_torchs_argmax(
    isa: Isa, threads: int
) -> None:
    """The cases of the test above written by the weights, with no bias: a call with a bias
    takes the scalar check, so only these reach the vector quick checks of the tiles after
    a row's best (found by review: a quick check that missed a NaN, or took an equal later
    value, passed every other test here)."""
    assert KERNELS is not None
    inf, nan = float("inf"), float("nan")
    cases = []
    tie = [0.01] * WEIGHT_ROWS
    for row in (7, 150, 290):
        tie[row] = 0.5
    cases.append(tie)
    late_tie = [0.01] * WEIGHT_ROWS
    late_tie[200] = late_tie[260] = 0.5  # both in the second thread's columns
    cases.append(late_tie)
    nans = [0.01 + 0.001 * (row % 17) for row in range(WEIGHT_ROWS)]
    for row in (180, 40, 250):
        nans[row] = nan
    nans[10] = inf
    cases.append(nans)
    late_nan = [0.01 + 0.001 * (row % 17) for row in range(WEIGHT_ROWS)]
    late_nan[297] = nan  # in the last, short unit
    cases.append(late_nan)
    cases.append([-inf] * WEIGHT_ROWS)
    infinite = [-inf] * WEIGHT_ROWS
    infinite[99] = infinite[230] = inf
    cases.append(infinite)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for scales in cases:
            blocks = scaled_rows(scales)
            layouts = [QuantSegment("Q8_0", torch.from_numpy(blocks))]
            interleaved = np.empty_like(blocks)
            KERNELS.repack8("Q8_0", blocks, interleaved)
            layouts.append(QuantSegment("Q8_0", torch.from_numpy(interleaved), interleaved=True))
            for segment in layouts:
                for rows in (1, 5, 16, 33):
                    x = torch.rand(rows, 256) + 0.5
                    want = KERNELS.matmul((segment,), x, out_dtype=torch.float32, isa=isa)
                    got = KERNELS.argmax((segment,), x, isa=isa)
                    assert torch.equal(got, want.argmax(dim=-1)), (scales, rows, got)
    finally:
        torch.set_num_threads(before)


def test_a_head_answers_none_where_its_call_would_not_take_the_blocks() -> None:
    """``GGMLLinear.argmax``: on the blocks its outputs' argmax; None where a call of that many
    rows takes a decoded matrix, or where its outputs would be rounded to bfloat16."""
    assert KERNELS is not None
    segment = segments("Q8_0")[0]
    x = torch.randn(9, 256).to(torch.bfloat16)
    head = GGMLLinear(KERNELS, (segment,), 256, out_dtype=torch.float32, dense_from_rows=8)
    assert head.argmax(x) is None  # 9 rows: decoded for the call
    assert torch.equal(head.argmax(x, as_rows=4), head(x, as_rows=4).argmax(dim=-1))
    assert GGMLLinear(KERNELS, (segment,), 256).argmax(x[:2]) is None  # bfloat16 outputs


def test_ties_and_nans_hold_when_tiles_are_taken_over() -> None:
    """Work stealing hands a thread tiles that lie before its own run's columns: an equal value
    or a NaN there is an earlier column and must win (found: the quick check that assumed each
    thread's columns in increasing order dropped it, the tie's later column came out). More
    threads than cores, so that some start late and the others take their last tiles."""
    assert KERNELS is not None
    columns = 1024  # 64 tiles
    zeros = QuantSegment("Q8_0", torch.zeros((columns, 34 * 8), dtype=torch.uint8))
    generator = torch.Generator().manual_seed(3)
    before_threads, taken = torch.get_num_threads(), KERNELS.tiles_taken_over
    torch.set_num_threads(8)
    try:
        for call in range(120):
            bias = torch.full((columns,), -1.0)
            bias[torch.randint(0, columns, (6,), generator=generator)] = 3.0
            if call % 3 == 2:
                bias[torch.randint(0, columns, (3,), generator=generator)] = float("nan")
            x = torch.randn(16, 256, generator=generator)
            got = KERNELS.argmax((zeros,), x, bias=bias)
            assert torch.equal(got, bias.expand(16, -1).argmax(dim=-1)), (call, bias, got)
    finally:
        torch.set_num_threads(before_threads)
    assert KERNELS.tiles_taken_over > taken, "no tile was taken over: the test proves nothing"


def test_a_heads_logits_reuse_the_threads_buffer_only_where_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``GGMLLinear.logits``: inside ``logits_in_thread_buffer`` the float32 outputs of calls
    on the blocks go to one buffer per thread (the same memory each step, grown to the largest
    call), with the values of a call of their own; outside it, and past the size limit, each
    call gets its own tensor (tests and scripts hold two steps' logits at once)."""
    assert KERNELS is not None
    segment = segments("Q8_0")[0]
    head = GGMLLinear(KERNELS, (segment,), 256, out_dtype=torch.float32)
    x = torch.randn(5, 256)
    want = head(x)
    first, second = head.logits(x), head.logits(x[:3])
    assert first.data_ptr() != second.data_ptr()  # outside: tensors of their own
    assert torch.equal(first, want)
    with logits_in_thread_buffer():
        first = head.logits(x)
        assert torch.equal(first, want)
        second = head.logits(x[:3])
        assert second.data_ptr() == first.data_ptr()
        assert torch.equal(second, want[:3])
        monkeypatch.setattr(ggml, "LOGITS_BUFFER_MAX_BYTES", 4 * 4 * WEIGHT_ROWS)
        big = head.logits(x)  # 5 rows: over the limit
        assert big.data_ptr() != first.data_ptr() and torch.equal(big, want)
    assert head.logits(x[:3]).data_ptr() != first.data_ptr()
