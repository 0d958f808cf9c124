"""Wide calls on GGUF blocks without a kept copy (``GGMLLinear.dense_from_rows``): the blocks
decoded to a bfloat16 matrix for one call (a long prompt chunk) and multiplied by oneDNN's GEMM,
while narrower calls, and the batch-invariant rows of a wide one, stay on the block kernels."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from make_random_gguf import write_random_gguf

from app.models.base import SamplingParams
from app.models.kernels.ggml_quant import QuantSegment, load_ggml_quant
from app.models.load.plan import load_checkpoint
from app.models.weights.ggml import (
    DENSE_FROM_ROWS,
    GGMLLinear,
    blocks_max_rows,
    decodes_wide_calls_here,
)
from app.models.weights.projections import LinearKernel, project, widens_to_float32
from tests.models.stepping import generate_alone, generate_together, load_on_blocks
from tests.models.test_ggml_kernels import random_blocks

KERNELS, HOW = load_ggml_quant()
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"GGUF-block kernels: {HOW}")

COLUMNS = 512
PARTS = [("Q4_K", 40), ("Q6_K", 24), ("Q8_0", 16)]  # a fused projection of three formats


def linear(dense_from_rows: int) -> GGMLLinear:
    assert KERNELS is not None
    segments = tuple(
        QuantSegment(kind, torch.from_numpy(random_blocks(kind, rows, COLUMNS, seed)))
        for seed, (kind, rows) in enumerate(PARTS)
    )
    bias = torch.randn(80, generator=torch.Generator().manual_seed(3))
    return GGMLLinear(KERNELS, segments, COLUMNS, bias, dense_from_rows=dense_from_rows)


def rows_of(count: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(count, COLUMNS, generator=torch.Generator().manual_seed(seed))
    return x.to(torch.bfloat16)


def test_decoded_is_the_files_own_decode_rounded_once() -> None:
    projection = linear(16)
    expected = np.concatenate(
        [
            gguf.quants.dequantize(s.blocks.numpy(), gguf.GGMLQuantizationType[s.tensor_type])
            for s in projection.segments
        ]
    ).reshape(80, COLUMNS)
    decoded = projection.decoded()
    assert decoded.dtype == torch.bfloat16 and decoded.shape == (80, COLUMNS)
    assert torch.equal(decoded, torch.from_numpy(expected).float().to(torch.bfloat16))


def test_wide_calls_decode_and_narrow_ones_stay_on_the_blocks() -> None:
    projection = linear(16)
    assert projection.exact_rows == 15
    x = rows_of(40)
    blocks = KERNELS.matmul(projection.prepared, x, bias=projection.bias)
    reference = x.double() @ projection.decoded().double().T + projection.bias.double()
    wide = projection(x)
    # the GEMM on the decoded matrix: bfloat16 rounding of the result, no activation
    # quantisation, so closer to the exact product than the blocks' 8-bit activations are
    scale = reference.abs().max().item()
    assert (wide.double() - reference).abs().max().item() <= 0.01 * scale
    assert not torch.equal(wide, blocks)  # it is not the block kernels' result
    assert torch.equal(projection(x[:15]), blocks[:15])  # under the threshold: the blocks
    residual = rows_of(40, seed=1)[:, :80].contiguous()
    added = projection.add_to(residual, x)
    assert (added.double() - (reference + residual.double())).abs().max().item() <= 0.02 * scale


def test_seeded_rows_of_a_wide_call_come_out_as_alone() -> None:
    """The rows that must be batch-invariant go through calls of at most ``exact_rows`` rows
    (``project``), the block kernels: bit for bit what they are alone."""
    projection = linear(16)
    x = rows_of(48)
    exact = torch.tensor([3, 17, 40])
    out = project(projection, x, exact)
    for row in exact.tolist():
        assert torch.equal(out[row], projection(x[row : row + 1])[0])


def test_a_float32_model_and_no_threshold_never_decode() -> None:
    x = rows_of(40).float()
    projection = linear(16)
    assert torch.equal(projection(x), KERNELS.matmul(projection.prepared, x, bias=projection.bias))
    off = linear(0)
    assert off.exact_rows > 10**6
    assert torch.equal(off(rows_of(40)), KERNELS.matmul(off.prepared, rows_of(40), bias=off.bias))


@pytest.fixture(scope="module")
def random_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dense_calls") / "model.gguf"
    return write_random_gguf(
        out, types="Q4_K,Q6_K,Q6_K", hidden=256, layers=1, heads=4, kv_heads=2, ffn=512
    )


@pytest.mark.parametrize("wide_copies", ["off", "on"])
def test_the_load_decodes_wide_calls_only_without_copies_on_an_amx_cpu(
    random_file: Path, wide_copies: str
) -> None:
    """Without AMX (the Zen 4 EPYC) the blocks beat decoding them for a wide call."""
    runner = load_on_blocks(random_file, wide_copies=wide_copies)
    qkv = runner.model.weights.layers[0].qkv
    assert isinstance(qkv, GGMLLinear)
    native = not widens_to_float32(torch.device("cpu"), torch.bfloat16)
    amx = torch.cpu._is_amx_tile_supported()
    assert decodes_wide_calls_here() == amx
    wanted = DENSE_FROM_ROWS if native and amx and wide_copies == "off" else 0
    assert qkv.dense_from_rows == wanted
    assert (runner.model.weights.kernel is LinearKernel.ONEDNN) == native


def test_the_c_layer_loop_leaves_the_decoded_calls_to_the_python_one(random_file: Path) -> None:
    """A step of as many rows as make a projection decode its blocks (a wave of short prompts
    reaches it) takes the Python layer loop, whose calls decode; fewer rows take the C loop on
    the blocks. Found: the C loop took a 32 x 16-token prompt wave of the 1B Q4_K file on the
    blocks, 2.5 s a step against 1.1 decoded."""
    runner = load_on_blocks(random_file, wide_copies="off")
    qkv = runner.model.weights.layers[0].qkv
    if qkv.dense_from_rows == 0:
        pytest.skip("no decoded calls on this CPU")
    model = runner.model
    assert model._decoder_layout(runner.cache, qkv.dense_from_rows - 1) is not None
    assert model._decoder_layout(runner.cache, qkv.dense_from_rows) is None


def test_a_wide_heads_logits_are_its_copys_bfloat16_product(random_file: Path) -> None:
    """A wide call of the LM head returns its dense copy's bfloat16 product as it is (no
    float32 conversion of 16.8 M logits a step at Gemma 3's vocabulary); a call on the blocks
    gives float32; a split call (``project``) widens the product so that its exact rows keep
    the blocks' float32 values."""
    head = load_on_blocks(random_file, wide_copies="on").model.weights.lm_head
    if not isinstance(head, GGMLLinear) or head.wide is None:
        pytest.skip("no dense copy of the head on this CPU")
    assert head.out_dtype == torch.float32
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(head.blocks_max_rows + 2, head.in_features, generator=generator)
    x = x.to(torch.bfloat16)
    wide = head(x)
    assert wide.dtype == torch.bfloat16 and torch.equal(wide, head.wide(x))
    narrow = head(x[:2].contiguous())  # on the blocks
    assert narrow.dtype == torch.float32
    assert torch.equal(narrow, KERNELS.matmul(head.prepared, x[:2], out_dtype=torch.float32))
    split = project(head, x, torch.tensor([0, 1]))
    assert split.dtype == torch.float32
    assert torch.equal(split[:2], narrow)
    assert torch.equal(split[2:], wide[2:].float())


def test_a_seeded_row_in_a_step_wider_than_the_blocks_gets_its_tokens_alone(
    random_file: Path,
) -> None:
    """A seeded sampled row beside enough greedy rows that the head's call takes the dense copy
    (bfloat16 logits): its own logits still come from the blocks in float32 (``project``'s
    exact rows), so it draws the tokens it draws alone."""
    slots = blocks_max_rows() + 3
    runner = load_checkpoint(
        random_file,
        max_num_seqs=slots,
        max_model_len=32,
        dtype="bfloat16",
        quantization="auto",
        wide_copies="on",
    )
    if runner.model.weights.lm_head.wide is None:
        pytest.skip("no dense copy of the head on this CPU")
    seeded = SamplingParams(temperature=1.0, seed=7, batch_invariant=True)
    prompt = [5, 17, 300, 41]
    alone = generate_alone(runner, 0, prompt, 6, seeded)
    prompts = {slot: [(slot * 37 + i) % 500 + 3 for i in range(4)] for slot in range(slots)}
    prompts[0] = prompt
    crowd = generate_together(runner, prompts, 6, {0: seeded})
    assert crowd[0] == alone


def test_a_seeded_requests_prompt_logprobs_come_from_the_heads_blocks(random_file: Path) -> None:
    """Prompt logprobs go through the LM head a block of positions at a time; a seeded
    request's (``exact``) are computed in calls the head computes alike, so a position scores
    the same in a prompt of any length (found by a helper: with a dense copy of the head, the
    first 20 positions of a 45-token prompt scored up to 0.09 nats off the same 20 alone)."""
    model = load_on_blocks(random_file, wide_copies="on").model
    head = model.weights.lm_head
    if not isinstance(head, GGMLLinear) or head.wide is None:
        pytest.skip("no dense copy of the head on this CPU")
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(head.blocks_max_rows + 9, head.in_features, generator=generator)
    hidden = hidden.to(torch.bfloat16)
    alone = model.output_logits(hidden[:3].contiguous())
    assert alone.dtype == torch.float32  # on the blocks
    assert torch.equal(model.output_logits(hidden, exact=True)[:3], alone)
    assert model.output_logits(hidden).dtype == torch.bfloat16  # unseeded: the copy


def test_a_decoded_heads_logits_are_the_decoded_product() -> None:
    """A decoded call of a head returns its bfloat16 product as a wide call does; its exact
    rows (calls on the blocks) come in float32, so a split call (``project``) is still right."""
    assert KERNELS is not None
    segments = linear(0).segments
    head = GGMLLinear(KERNELS, segments, COLUMNS, out_dtype=torch.float32, dense_from_rows=4)
    x = rows_of(6, seed=5)
    decoded = torch.nn.functional.linear(x, head.decoded())
    alone = head(x[[0, 2]].contiguous())  # on the blocks
    assert alone.dtype == torch.float32
    whole = head(x)
    assert whole.dtype == torch.bfloat16 and torch.equal(whole, decoded)
    split = project(head, x, torch.tensor([0, 2]))  # rows 0 and 2 as alone
    assert split.dtype == torch.float32
    assert torch.equal(split[[0, 2]], alone)
    assert torch.equal(split[[1, 3, 4, 5]], decoded[[1, 3, 4, 5]].float())
