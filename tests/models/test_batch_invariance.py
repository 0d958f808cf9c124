"""Seeded requests are batch-invariant bit for bit (API.md, ``seed``), in bfloat16, int8, int4.

A target sequence is teacher-forced through the same tokens twice: alone (one prompt chunk,
then one-row decode steps) and in a crowd (its prompt cut into uneven chunks that share steps
with other prompts, decode steps with more rows than one exact matmul call holds, other rows
of every length). Its logits must be equal in every step, not just close.
"""

from __future__ import annotations

import pytest
import torch

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.forward.decoder import DecoderModel
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import KVCache
from app.models.load.smollm2 import smollm2_gguf_path
from app.models.runner import ModelRunner
from app.models.tokenizers import load_gguf_tokenizer
from app.models.weights.int4 import int4_kernel_status
from app.models.weights.projections import (
    EXACT_ROWS_ONEDNN_BF16,
    LinearKernel,
    select_linear_kernel,
    widens_to_float32,
)
from app.models.weights.record import Quantization
from tests.models.stepping import decoder_of

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
CROWD = EXACT_ROWS_ONEDNN_BF16 + 8  # more rows than one exact call holds
MAX_LEN = 256
TARGET = 7  # the target's slot in the crowd


def _model(dtype: torch.dtype, quantization: Quantization) -> DecoderModel:
    kernel, _ = select_linear_kernel(CPU, dtype)
    return decoder_of(
        smollm2_gguf_path(),
        dtype=dtype,
        quantization=quantization,
        kernel=kernel,
        max_model_len=MAX_LEN,
    )


@pytest.fixture(scope="module", params=["bfloat16", "int8", "int4"])
def model(request: pytest.FixtureRequest) -> DecoderModel:
    """The model of the session's bfloat16 and int8 runners (tests/models/conftest.py: the
    kernel ``select_linear_kernel`` picks, ``MAX_LEN`` positions); int4 built here."""
    shared = {"bfloat16": "bf16_runner", "int8": "int8_runner"}.get(request.param)
    if shared is not None:
        runner = request.getfixturevalue(shared)
        assert runner.max_model_len == MAX_LEN and runner.model.dtype == torch.bfloat16
        return runner.model
    if request.param == "int4" and not int4_kernel_status()[0]:
        pytest.skip(int4_kernel_status()[1])
    return _model(torch.bfloat16, Quantization(request.param))


def test_greedy_answer_is_paris(model: DecoderModel) -> None:
    """A sanity check of each kind of weights: greedy decoding of a known prompt."""
    tokenizer = load_gguf_tokenizer(GGUFFile(smollm2_gguf_path()))
    prompt = tokenizer.encode("The capital of France is")
    steps = [[RowSpec(0, prompt, 0, True)]]
    cache = KVCache(model.hparams, max_num_seqs=1, max_model_len=64, dtype=model.dtype, device=CPU)
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(3):
            logits = model.forward(ForwardPlan.build(steps[-1], cache=cache), cache)
            generated.append(int(logits[0].argmax()))
            steps.append([RowSpec(0, [generated[-1]], len(prompt) + len(generated) - 1, True)])
    assert tokenizer.decode_bytes(generated).startswith(b" Paris")


def _target_logits(
    model: DecoderModel, steps: list[list[RowSpec]], target_slot: int
) -> list[torch.Tensor]:
    """Run ``steps`` on a fresh cache; the target's logits of every step that asks for them."""
    cache = KVCache(
        model.hparams, max_num_seqs=CROWD + 1, max_model_len=MAX_LEN, dtype=model.dtype, device=CPU
    )
    found = []
    with torch.inference_mode():
        for rows in steps:
            logits = model.forward(ForwardPlan.build(rows, cache=cache), cache)
            wanting = [r.slot for r in rows if r.want_logits]
            if target_slot in wanting:
                found.append(logits[wanting.index(target_slot)].clone())
    return found


def test_a_seeded_row_computes_the_same_alone_and_in_any_crowd(model: DecoderModel) -> None:
    _check_alone_equals_crowd(model)


def test_with_one_thread_too(bf16_runner: ModelRunner) -> None:
    """The kernels split their work by thread count (``--torch-threads``): one thread as well.

    With one thread, decode attention once took SDPA's ``enable_gqa`` layout for every row,
    which can round a lone query row an ulp away from a prompt chunk's: a seeded row's
    one-token chunk then broke equality (step 0). Attention is the same code whatever the
    weight format, so this runs with the bfloat16 weights only (a run is ~25 s of a 2-core
    AVX2 CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_alone_equals_crowd(bf16_runner.model)
    finally:
        torch.set_num_threads(threads)


def _check_alone_equals_crowd(model: DecoderModel) -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = model.hparams.vocab_size

    def tokens(count: int) -> list[int]:
        return torch.randint(0, vocab, (count,), generator=generator).tolist()

    prompt, forced = tokens(150), tokens(6)  # the target's prompt and the tokens it is fed

    def target(position: int, ids: list[int], slot: int, logits: bool = True) -> RowSpec:
        return RowSpec(slot, ids, position, logits, batch_invariant=True)

    alone = [[target(0, prompt, 0)]] + [
        [target(len(prompt) + i, [token], 0)] for i, token in enumerate(forced)
    ]

    # The crowd: CROWD slots with prompts of assorted lengths (rows of every key length, some
    # past the target's, some in another KEY_ALIGN block), one of them also seeded; every
    # fourth one long (3-243 tokens), the others short (the first step prefills them all).
    others = {
        slot: tokens(3 + 6 * slot if slot % 4 == 0 else 3 + slot) for slot in range(CROWD + 1)
    }
    others.pop(TARGET)
    crowd: list[list[RowSpec]] = [
        [RowSpec(slot, ids, 0, False, batch_invariant=slot == 3) for slot, ids in others.items()],
        # the target's prompt in three uneven chunks, sharing steps with others' decode rows
        [target(0, prompt[:41], TARGET, False), *_decode_rows(others, 0)],
        [target(41, prompt[41:42], TARGET, False)],  # a one-token chunk: decode-style attention
        [target(42, prompt[42:], TARGET), *_decode_rows(others, 1)],
    ]
    sizes = [CROWD, 3, EXACT_ROWS_ONEDNN_BF16 + 1, 1, EXACT_ROWS_ONEDNN_BF16, 17]
    for i, (token, size) in enumerate(zip(forced, sizes, strict=True)):
        rows = [target(len(prompt) + i, [token], TARGET), *_decode_rows(others, 2 + i)]
        crowd.append(rows[:size])  # a different crowd size every step

    expected = _target_logits(model, alone, 0)
    got = _target_logits(model, crowd, TARGET)
    assert len(expected) == len(got) == 1 + len(forced)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max()}"


def _decode_rows(prompts: dict[int, list[int]], step: int) -> list[RowSpec]:
    """One decode row per slot (token 5), after its prompt and ``step`` earlier decodes."""
    return [
        RowSpec(slot, [5], len(ids) + step, True, batch_invariant=slot == 3)
        for slot, ids in prompts.items()
    ]


def test_dense_bfloat16_kernel_is_what_the_crowd_test_exercises() -> None:
    """The crowd test is about the dense kernel a bfloat16 model gets here: oneDNN's bfloat16
    wherever this torch build and CPU report it, else (an AVX2 CPU) oneDNN's float32 over
    float32 copies of the weights; the selection must pick it and say why."""
    kernel, reason = select_linear_kernel(CPU, torch.bfloat16)
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if native:
        assert kernel is LinearKernel.ONEDNN, reason
    elif torch.backends.mkldnn.is_available():
        assert kernel is LinearKernel.ONEDNN_FLOAT32, reason
    assert widens_to_float32(CPU, torch.bfloat16) == (kernel is LinearKernel.ONEDNN_FLOAT32)
    assert reason
