"""The performance paths of the real model compute what the plain ones do: oneDNN-packed and
int8 projections, both decode attention layouts, mixed steps, the lazily zeroed KV cache, the
two-level argmax, and every path kept batch-invariant for seeded requests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.models.base import NULL_BLOCK, SamplingParams, StepBatch, StepRow, TokenLogprobs
from app.models.checkpoints.gguf_file import GGUFFile
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import KEY_ALIGN, KV_BLOCK_SIZE, KVCache, blocks_for
from app.models.hparams import HParams
from app.models.load.smollm2 import smollm2_gguf_path
from app.models.runner import ModelRunner
from app.models.sampling.sampler import ARGMAX_BLOCK, argmax_rows
from app.models.weights.embeddings import FileRowsEmbedding
from app.models.weights.int8 import INT8_MAX_ROWS, Int8Embedding, Int8Linear
from app.models.weights.projections import (
    DenseLinear,
    LinearKernel,
    PackedLinear,
    dense_projection,
    packed_exact_rows,
    select_linear_kernel,
)
from tests.models.stepping import GREEDY, generate_alone, generate_together

# Two bfloat16 roundings of a logit near 16-32 (ulp 0.125): how far apart two logits may come
# out of two batch shapes and still count as tied.
BF16_LOGIT_ROUNDING = 0.25

SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
CPU = torch.device("cpu")
ONEDNN = select_linear_kernel(CPU, torch.bfloat16)[0] is LinearKernel.ONEDNN
ONEDNN_FLOAT32 = select_linear_kernel(CPU, torch.float32)[0] is LinearKernel.ONEDNN_FLOAT32


def _smollm2_hparams() -> HParams:
    file = GGUFFile(smollm2_gguf_path())
    return file.hparams(file.architecture())


def _weights(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator) * 0.05


# --------------------------------------------------------------------------- projections


@pytest.mark.skipif(not ONEDNN, reason="no oneDNN bfloat16 on this CPU")
def test_packed_linear_equals_the_dense_matmul() -> None:
    weight = _weights(96, 64).to(torch.bfloat16)
    dense, packed = DenseLinear(weight), PackedLinear.pack(weight)
    x = torch.randn(7, 64).to(torch.bfloat16)
    residual = torch.randn(7, 96).to(torch.bfloat16)
    torch.testing.assert_close(packed(x), dense(x), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(packed.add_to(residual, x), dense.add_to(residual, x))
    rows = torch.cat([packed(x[i : i + 1]) for i in range(7)])
    assert torch.equal(rows, packed(x))  # a row does not depend on the other rows


@pytest.mark.skipif(not ONEDNN_FLOAT32, reason="no oneDNN float32 packing in this torch build")
@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "bias"])
def test_float32_packed_weights_serve_a_bfloat16_model(with_bias: bool) -> None:
    """ONEDNN_FLOAT32 for a bfloat16 model (a CPU without bfloat16 matmuls): the bfloat16
    weights' float32 product, rounded to bfloat16 once, the residual added before rounding;
    and each row the same in any call of up to the probed ``exact_rows`` rows."""
    weight = _weights(96, 64).to(torch.bfloat16)
    bias = _weights(1, 96, seed=1)[0].to(torch.bfloat16) if with_bias else None
    linear = dense_projection(weight, LinearKernel.ONEDNN_FLOAT32, bias)
    assert isinstance(linear, PackedLinear) and linear.compute_dtype == torch.float32
    assert linear.exact_rows == packed_exact_rows(torch.float32, 64) >= 1
    rows = max(linear.exact_rows, 7)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    residual = torch.randn(rows, 96).to(torch.bfloat16)
    product = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    out, added = linear(x), linear.add_to(residual, x)
    assert out.dtype == added.dtype == torch.bfloat16
    # one rounding of a float32 sum: within half a bfloat16 ulp of the exact value, plus the
    # float32 sum's own error
    ulp = 2.0 ** (torch.floor(torch.log2(product.abs().clamp(min=1e-30))) - 7)
    assert ((out.double() - product).abs() <= 0.5 * ulp + 1e-6).all()
    with_residual = product + residual.double()
    ulp = 2.0 ** (torch.floor(torch.log2(with_residual.abs().clamp(min=1e-30))) - 7)
    assert ((added.double() - with_residual).abs() <= 0.5 * ulp + 1e-6).all()
    alone = torch.cat([linear(x[i : i + 1]) for i in range(rows)])
    exact = linear.exact_rows
    assert torch.equal(alone[:exact], linear(x[:exact]))


def test_int8_kernels_agree_with_each_other_and_the_float_weight() -> None:
    """The int8 kernel (few rows) and the bfloat16 path over the dequantised weights (more rows)
    compute the same product, up to bfloat16 rounding."""
    weight = _weights(96, 64)
    linear = Int8Linear.quantize(weight, torch.bfloat16, LinearKernel.DENSE)
    assert linear.qweight.dtype == torch.int8
    dequantized = linear.qweight.float() * linear.scales.float()[:, None]
    assert (dequantized - weight).abs().max() <= linear.scales.float().max() * 0.51

    x = torch.randn(INT8_MAX_ROWS + 5, 64).to(torch.bfloat16)
    wide = linear(x)  # more rows than INT8_MAX_ROWS: the bfloat16 path
    narrow = torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])])  # the int8 kernel
    reference = x.float() @ weight.T
    scale = reference.abs().max().item()
    assert (narrow.float() - wide.float()).abs().max().item() < 0.02 * scale
    assert (wide.float() - reference).abs().max().item() < 0.03 * scale
    residual = torch.randn(1, 96).to(torch.bfloat16)
    assert torch.equal(linear.add_to(residual, x[:1]), narrow[:1] + residual)


def test_int8_embedding_reads_the_lm_head_rows(int8_runner: ModelRunner) -> None:
    weights = int8_runner.model.weights
    assert isinstance(weights.embedding, Int8Embedding)
    assert isinstance(weights.lm_head, Int8Linear)
    ids = torch.tensor([0, 5, 49151])
    rows = weights.embedding(ids)
    expected = weights.lm_head.qweight[ids].float() * weights.lm_head.scales[ids, None].float()
    torch.testing.assert_close(rows.float(), expected, rtol=2**-8, atol=0)  # bfloat16 rounding


# --------------------------------------------------------------------------- attention and steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q8_0_embedding_reads_the_dense_matrix_values(dtype: torch.dtype) -> None:
    file = GGUFFile(smollm2_gguf_path())
    hparams = file.hparams(file.architecture())
    assert file.tensor_type("token_embd.weight") == "Q8_0"
    dense = torch.from_numpy(file.read_tensor("token_embd.weight")).to(dtype)
    lookup = FileRowsEmbedding(file.tensor_rows("token_embd.weight"), dtype)
    ids = torch.cat([torch.tensor([0, 1, hparams.vocab_size - 1, 1]), torch.randperm(49152)[:3000]])
    rows = lookup(ids)
    assert rows.dtype == dtype and rows.shape == (len(ids), hparams.embedding_length)
    assert torch.equal(rows, dense[ids])  # bit-equal: d * q is exact in float32


@pytest.mark.skipif(not ONEDNN, reason="needs oneDNN bfloat16")
def test_bf16_lm_head_is_packed_and_the_lookup_reads_the_file(
    bf16_runner: ModelRunner,
) -> None:
    weights = bf16_runner.model.weights
    assert isinstance(weights.lm_head, PackedLinear)
    assert isinstance(weights.embedding, FileRowsEmbedding)
    file = GGUFFile(smollm2_gguf_path())
    dense = torch.from_numpy(file.read_tensor("token_embd.weight"))
    x = torch.randn(5, dense.shape[1]).to(torch.bfloat16)
    # the packed head multiplies by the same bfloat16 matrix as the dense tied one
    torch.testing.assert_close(
        weights.lm_head(x).float(),
        (x.float() @ dense.to(torch.bfloat16).float().T),
        rtol=2e-2,
        atol=2e-2,
    )


def test_decode_attention_layouts_agree(runner: ModelRunner) -> None:
    """Query heads folded into the query axis, or SDPA's own GQA: the same attention."""
    model = runner.model
    cache = KVCache(
        model.hparams, max_num_seqs=4, max_model_len=64, dtype=model.dtype, device=model.device
    )
    prompts = {0: list(range(100, 109)), 2: list(range(200, 205)), 3: list(range(300, 317))}
    with torch.inference_mode():
        plan = ForwardPlan.build([RowSpec(s, p, 0, True) for s, p in prompts.items()], cache=cache)
        first = model.forward(plan, cache).argmax(dim=-1).tolist()
        rows = [
            RowSpec(slot, [token], len(prompts[slot]), True)
            for slot, token in zip(prompts, first, strict=True)
        ]
        plan = ForwardPlan.build(rows, cache=cache)  # slots 0, 2, 3: rows of three lengths
        assert plan.decode is not None and plan.decode.mask is not None
        results = []
        for fold in (True, False):
            decode = dataclasses.replace(plan.decode, fold_query_heads=fold)
            results.append(model.forward(dataclasses.replace(plan, decode=decode), cache))
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-4)


def test_the_eager_paths_masks_and_gather_positions_are_made_on_first_use(
    runner: ModelRunner,
) -> None:
    """A step the fused kernels take never reads the decode group's mask, its key positions or
    the plan's cache index: none is built with the plan; the eager path's first read makes
    each, once, as they were made before."""
    model = runner.model
    cache = KVCache(
        model.hparams, max_num_seqs=4, max_model_len=64, dtype=model.dtype, device=model.device
    )
    lengths = {0: 10, 2: 6, 3: 18}
    plan = ForwardPlan.build(
        [RowSpec(s, [7], n - 1, True) for s, n in lengths.items()], cache=cache
    )
    decode = plan.decode
    assert decode is not None and not decode.made and not plan.made
    mask = decode.mask
    assert mask is decode.mask and mask is not None
    keys = torch.arange(decode.key_length)
    for row, length in enumerate(lengths.values()):
        assert torch.equal(mask[row, 0, 0] == float("-inf"), keys >= length)
        assert torch.equal(mask[row, 0, 0][keys < length], torch.zeros(length, dtype=model.dtype))
    tables = [list(cache.slot_blocks(s)) for s in lengths]
    width = decode.key_length // KV_BLOCK_SIZE
    expected = [
        (table[k // KV_BLOCK_SIZE] if k // KV_BLOCK_SIZE < blocks_for(n) else NULL_BLOCK)
        * KV_BLOCK_SIZE
        + k % KV_BLOCK_SIZE
        for table, n in zip(tables, lengths.values(), strict=True)
        for k in range(width * KV_BLOCK_SIZE)
    ]
    assert (
        decode.key_positions.tolist() == expected and decode.key_positions is decode.key_positions
    )
    assert torch.equal(plan.cache_index, cache.write_index(plan.flat_positions))
    assert plan.cache_index is plan.cache_index


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_a_mixed_step_equals_separate_steps(
    kind: str,
    runner: ModelRunner,
    bf16_runner: ModelRunner,
    int8_runner: ModelRunner,
) -> None:
    """Decode rows and a prompt chunk in one step give the tokens they give in steps of their
    own (the scheduler mixes them whenever the token budget allows): the same tokens in
    float32; in bfloat16, where a matmul of 15 rows and one of 13 may round differently (only
    seeded rows are promised the same tokens in any batch: test_batch_invariance.py), the same
    tokens but where the two runs' top two are within bfloat16's rounding of each other."""
    model = {"float32": runner, "bfloat16": bf16_runner, "int8": int8_runner}[kind]
    tok = model.tokenizer
    decoding = {0: tok.encode("The capital of France is"), 1: tok.encode("List three colours:")}
    arriving = tuple(tok.encode("Write a short poem about the sea and the sky, please."))
    greedy = dataclasses.replace(GREEDY, logprobs=2)

    def run(mixed: bool) -> list[TokenLogprobs]:
        first = [
            model.step(StepBatch((StepRow(s, tuple(p), 0, True, GREEDY),))).next_token_ids[0]
            for s, p in decoding.items()
        ]
        decode_rows = tuple(
            StepRow(slot, (token,), len(decoding[slot]), True, greedy)
            for slot, token in zip(decoding, first, strict=True)
        )
        chunk = StepRow(2, arriving, 0, True, greedy)
        if mixed:
            rows = model.step(StepBatch((*decode_rows, chunk))).rows
        else:
            rows = (*model.step(StepBatch(decode_rows)).rows, *model.step(StepBatch((chunk,))).rows)
        out = tuple(row.logprobs for row in rows)
        for slot in (0, 1, 2):
            model.release(slot)
        assert out is not None and all(entry is not None for entry in out)
        return list(out)

    mixed, separate = run(mixed=True), run(mixed=False)
    if kind == "float32":
        assert [e.token_id for e in mixed] == [e.token_id for e in separate]
    for a, b in zip(mixed, separate, strict=True):
        top_a, top_b = dict(a.top), dict(b.top)
        assert a.token_id == b.token_id or (
            a.token_id in top_b
            and b.token_id in top_a
            and abs(top_a[a.token_id] - top_a[b.token_id]) <= BF16_LOGIT_ROUNDING
            and abs(top_b[a.token_id] - top_b[b.token_id]) <= BF16_LOGIT_ROUNDING
        ), (a, b)


# --------------------------------------------------------------------------- batch invariance


def test_seeded_sampling_is_batch_invariant_in_float32_with_one_thread(
    runner: ModelRunner,
) -> None:
    """The float32 model keeps the API's seeded batch invariance with one torch thread, where
    decode attention takes SDPA's own GQA layout except in steps with a seeded row. (bfloat16,
    int8 and int4, bit for bit: tests/models/test_batch_invariance.py.)"""
    tok = runner.tokenizer
    prompt = tok.encode("Write a short poem about the sea.")
    crowd_prompts = {
        0: tok.encode("List three colours:"),
        3: prompt,
        5: tok.encode("Tell me a joke about cats and dogs and birds."),
        6: tok.encode("1 2 3 4"),
    }
    sampling = {
        0: GREEDY,
        3: SEEDED,
        5: SamplingParams(temperature=1.0, top_k=40, seed=123),
        6: SamplingParams(temperature=0.8, top_p=0.9, seed=8),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = generate_alone(runner, 3, prompt, 12, SEEDED)
        crowd = generate_together(runner, crowd_prompts, 12, sampling)
    finally:
        torch.set_num_threads(threads)
        for slot in crowd_prompts:
            runner.release(slot)
    assert crowd[3] == alone


# --------------------------------------------------------------------------- cache and sampler


def test_kv_cache_is_zero_and_writable() -> None:
    hp = _smollm2_hparams()
    cache = KVCache(hp, max_num_seqs=2, max_model_len=30, dtype=torch.bfloat16, device=CPU)
    # slots of whole KEY_ALIGN blocks (attention reads whole blocks): 30 -> 2 blocks a slot,
    # plus the null block
    assert KV_BLOCK_SIZE == KEY_ALIGN and cache.num_blocks == 1 + 2 * 2
    assert cache.keys.shape == (hp.block_count, hp.head_count_kv, 5 * KEY_ALIGN, hp.head_dim)
    assert list(cache.slot_blocks(1)) == [3, 4]
    assert cache.keys.dtype == torch.bfloat16
    assert not cache.keys.any() and not cache.values.any()
    flat = cache.slot_blocks(1)[1] * KV_BLOCK_SIZE + 15  # slot 1, position 31
    index = cache.write_index(torch.tensor([flat]))
    keys = torch.ones(1, hp.head_count_kv, hp.head_dim, dtype=torch.bfloat16)
    cache.write(0, index, keys, keys * 2)
    assert cache.keys[0, :, flat].eq(1).all() and cache.values[0, :, flat].eq(2).all()
    assert cache.keys.sum() == hp.head_count_kv * hp.head_dim
    gathered, _ = cache.gather(0, torch.arange(4 * KV_BLOCK_SIZE, 5 * KV_BLOCK_SIZE), 1)
    assert gathered.shape == (1, hp.head_count_kv, KV_BLOCK_SIZE, hp.head_dim)
    assert gathered[0, :, 15].eq(1).all() and gathered.sum() == hp.head_count_kv * hp.head_dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_argmax_including_ties(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 4 * ARGMAX_BLOCK, generator=generator) * 3).to(dtype)
    logits[0, 10] = logits[0, 3 * ARGMAX_BLOCK + 7] = 100.0  # tie across blocks: the first
    logits[1, 2 * ARGMAX_BLOCK + 1] = logits[1, 2 * ARGMAX_BLOCK + 9] = 100.0  # inside one
    logits[2] = 0.0  # all equal: index 0
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    odd = torch.randn(3, 1000).to(dtype)  # not a multiple of the block: plain argmax
    assert torch.equal(argmax_rows(odd), odd.argmax(dim=-1))
