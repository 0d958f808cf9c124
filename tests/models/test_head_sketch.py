"""The greedy LM head on a six-bit sketch (``app/models/weights/head_sketch.py``,
``ggml_quant_sketch.c``): the same index as the whole head's call, bit for bit, on random
matrices of both layouts, on every instruction set here, with exact ties, rows that only the
dropped bits tell apart, and inputs it cannot bound; and on a real model's hidden states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.models.base import SamplingParams, StepBatch, StepRow
from app.models.kernels.ggml_quant import Isa, QuantSegment, load_ggml_quant
from app.models.load.plan import load_checkpoint
from app.models.weights import head_sketch
from app.models.weights.ggml import GGMLLinear
from app.models.weights.head_sketch import HeadSketch
from tests.models.test_ggml_kernels import random_blocks

KERNELS, HOW = load_ggml_quant()
pytestmark = pytest.mark.skipif(
    KERNELS is None or KERNELS.isa < Isa.AVX2, reason=f"GGUF-block kernels with AVX2: {HOW}"
)
ISAS = [isa for isa in (Isa.AVX2, Isa.AVX512) if KERNELS is not None and KERNELS.supports(isa)]
BLOCK = 34  # bytes of a Q8_0 block: fp16 d, 32 int8 codes


@pytest.fixture(autouse=True)
def small_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_sketch, "SKETCH_MIN_ROWS", 8)


def q8_0_blocks(rows: int, columns: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """Random Q8_0 rows with non-negative scales around ``scale`` (as a quantiser writes)."""
    blocks = random_blocks("Q8_0", rows, columns, seed=seed).reshape(rows, -1, BLOCK)
    generator = np.random.default_rng(seed)
    d = (scale * (0.5 + generator.random(blocks.shape[:2]))).astype(np.float16)
    blocks[:, :, :2] = d.view(np.uint8).reshape(*d.shape, 2)
    return blocks.reshape(rows, -1)


def segment_of(blocks: np.ndarray, interleaved: bool) -> QuantSegment:
    assert KERNELS is not None
    if not interleaved:
        return QuantSegment("Q8_0", torch.from_numpy(blocks.copy()))
    out = np.empty_like(blocks)
    KERNELS.repack8("Q8_0", blocks, out)
    return QuantSegment("Q8_0", torch.from_numpy(out), interleaved=True)


def check(blocks: np.ndarray, x: torch.Tensor, *, interleaved: bool) -> list[int]:
    """The sketched argmax against the whole head's for each ISA; the exact rows of each."""
    assert KERNELS is not None
    segment = segment_of(blocks, interleaved)
    sketch = HeadSketch.build(KERNELS, segment, x.shape[1])
    assert sketch is not None
    exact = []
    for isa in ISAS:
        want = KERNELS.argmax((segment,), x, isa=isa)
        found = sketch.argmax(x, isa=isa)
        assert found is not None
        assert int(found[0][0]) == int(want[0]), f"{isa.name} {blocks.shape} {interleaved}"
        exact.append(found[1])
    return exact


@pytest.mark.parametrize("interleaved", [True, False], ids=["x8", "file"])
def test_the_sketched_argmax_is_the_whole_heads(interleaved: bool) -> None:
    """Shapes with a tail after the last full group and without, one block to 24, float32 and
    bfloat16 activations."""
    generator = torch.Generator().manual_seed(0)
    for trial, (rows, columns) in enumerate(
        [(8, 32), (13, 64), (403, 640), (2048, 96), (999, 768)]
    ):
        blocks = q8_0_blocks(rows, columns, seed=trial)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(1, columns, generator=generator).to(dtype)
            check(blocks, x, interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [True, False], ids=["x8", "file"])
def test_ties_and_rows_only_the_dropped_bits_tell_apart(interleaved: bool) -> None:
    """A row copied to several places (one a tail row): the first copy wins, as torch's
    argmax. Rows that differ from it only in the codes' two low bits (the sketch cannot tell
    them apart): the exact pass decides, whichever way the bits point."""
    rows, columns = 1029, 256
    generator = np.random.default_rng(5)
    for trial in range(6):
        blocks = q8_0_blocks(rows, columns, seed=10 + trial).reshape(rows, -1, BLOCK)
        best = blocks[7].copy()
        x = torch.from_numpy(best[:, 2:].view(np.int8).astype(np.float32).reshape(1, -1))
        copies = [40, 41, 500, 1027] if trial % 2 else [41, 1027, 40]
        for row in copies:
            blocks[row] = best
        for row in (3, 300, 1024):  # nudged in the low bits only, up or down
            nudged = best.copy()
            codes = nudged[:, 2:].view(np.int8)
            bump = generator.integers(-1, 2, size=codes.shape).astype(np.int16)
            low = codes.astype(np.int16) & 3
            codes[:] = (codes.astype(np.int16) - low + np.clip(low + bump, 0, 3)).astype(np.int8)
            blocks[row] = nudged
        check(blocks.reshape(rows, -1), x, interleaved=interleaved)


def test_the_bounds_hold_where_the_dropped_bits_decide() -> None:
    """The dropped bits (0-3 a code) are all that separates the argmax from a row whose
    six-bit codes are larger: with activations all +1, row 10's codes 43 (six bits 40, exact
    43) beat row 3's 44 / 40 mix (42.5); with all -1, row 30's -44 / -40 mix (41.5) beats row
    20's -41 (six bits -44, exact 41). Bounds narrower than the 0-3 range lose both."""
    rows, columns = 64, 64
    blocks = q8_0_blocks(rows, columns, seed=4, scale=0.0005).reshape(rows, -1, BLOCK)

    def set_row(row: int, codes: list[int]) -> None:
        blocks[row, :, :2] = np.array([0.01], dtype=np.float16).view(np.uint8)
        blocks[row, :, 2:] = np.array(codes, dtype=np.int8).view(np.uint8)

    set_row(10, [43] * 32)
    set_row(3, [44] * 20 + [40] * 12)
    set_row(20, [-41] * 32)
    set_row(30, [-44] * 12 + [-40] * 20)
    for sign, winner in ((1.0, 10), (-1.0, 30)):
        x = torch.full((1, columns), sign)
        assert KERNELS is not None
        assert int(KERNELS.argmax((segment_of(blocks.reshape(rows, -1), True),), x)[0]) == winner
        for interleaved in (True, False):
            check(blocks.reshape(rows, -1), x, interleaved=interleaved)


def test_the_sketch_computes_few_rows_exactly() -> None:
    """On 16,384 random rows the bounds leave a small share to the exact pass (else the sketch
    would read more than the head)."""
    blocks = q8_0_blocks(16384, 640, seed=3)
    x = torch.randn(1, 640, generator=torch.Generator().manual_seed(3))
    assert max(check(blocks, x, interleaved=True)) < 16384 // 16


def test_inputs_the_bounds_cannot_hold_take_the_whole_heads_call() -> None:
    """A NaN or an infinity in the activations: no answer from the sketch, and GGMLLinear's
    argmax is the whole head's (a NaN output is torch's largest)."""
    assert KERNELS is not None
    blocks = q8_0_blocks(64, 64, seed=1)
    segment = segment_of(blocks, True)
    sketch = HeadSketch.build(KERNELS, segment, 64)
    assert sketch is not None
    head = GGMLLinear(KERNELS, (segment,), 64, out_dtype=torch.float32, sketch=sketch)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
        x[0, 5] = bad
        assert sketch.argmax(x) is None
        assert torch.equal(head.argmax(x), KERNELS.argmax((segment,), x))


def test_no_sketch_for_scales_it_cannot_bound_or_when_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert KERNELS is not None
    for d in (-0.01, float("inf"), float("nan")):
        blocks = q8_0_blocks(64, 64, seed=1).reshape(64, -1, BLOCK)
        blocks[9, 1, :2] = np.array([d], dtype=np.float16).view(np.uint8)
        assert HeadSketch.build(KERNELS, segment_of(blocks.reshape(64, -1), True), 64) is None
    blocks = q8_0_blocks(64, 64, seed=1)
    assert HeadSketch.build(KERNELS, segment_of(blocks, True), 64) is not None
    monkeypatch.setenv("SLOTSERVE_GGML_HEAD_SKETCH", "0")
    assert HeadSketch.build(KERNELS, segment_of(blocks, True), 64) is None
    q4 = QuantSegment("Q4_0", torch.from_numpy(random_blocks("Q4_0", 64, 64, seed=1)))
    monkeypatch.delenv("SLOTSERVE_GGML_HEAD_SKETCH")
    assert HeadSketch.build(KERNELS, q4, 64) is None


def test_smollm2s_head_answers_greedy_rows_from_its_sketch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled model's 49,152-row Q8_0 head, loaded as the server loads it, gets a sketch;
    on its own hidden states (a greedy decode, captured at the head) the sketch's index is the
    whole head's."""
    runner = load_checkpoint(
        "smollm2", max_num_seqs=1, max_model_len=64, dtype="bfloat16", quantization="auto"
    )
    head = runner.model.weights.lm_head
    assert isinstance(head, GGMLLinear) and head.sketch is not None
    assert head.sketch.nbytes == head.nbytes * 26 // 34
    captured: list[torch.Tensor] = []
    real = GGMLLinear.argmax

    def capture(self: GGMLLinear, x: torch.Tensor, **kwargs: object) -> torch.Tensor | None:
        captured.append(x.clone())
        return real(self, x, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(GGMLLinear, "argmax", capture)
    greedy = SamplingParams(temperature=0.0)
    prompt = tuple(runner.tokenizer.encode("The capital of France is"))
    try:
        token = runner.step(StepBatch((StepRow(0, prompt, 0, True, greedy),)))
        token_id, position = token.next_token_ids[0], len(prompt)
        for _ in range(12):
            out = runner.step(StepBatch((StepRow(0, (token_id,), position, True, greedy),)))
            token_id, position = out.next_token_ids[0], position + 1
    finally:
        runner.release(0)
    assert len(captured) == 13
    for x in captured:
        found = head.sketch.argmax(x)
        assert found is not None
        assert torch.equal(found[0], head.kernels.argmax(head.prepared, x))
