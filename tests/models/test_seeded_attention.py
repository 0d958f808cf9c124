"""A seeded prompt's attention does not depend on how the prompt was cut into chunks.

SDPA's CPU kernel does not promise a query row the same rounding for every query length: on a
2-core AVX2 EPYC a prompt row attended inside a 150-row chunk and the same row attended alone
(a one-token chunk, or a decode row) differed in bfloat16 and in float32, with SmolLM2's own
activations. A seeded chunk is therefore attended token by token in the decode rows' layout
(``PrefillGroup.batch_invariant``, :mod:`app.models.forward.attention`); unseeded chunks keep SDPA's
causal chunk.
"""

from __future__ import annotations

import pytest
import torch

from app.models.forward.decoder import DecoderModel
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import KV_BLOCK_SIZE, KVCache
from app.models.runner import ModelRunner

PROMPT_LENGTH = 48


def _prompt(model: DecoderModel) -> list[int]:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(
        0, model.hparams.vocab_size, (PROMPT_LENGTH,), generator=generator
    ).tolist()


def _run(
    model: DecoderModel, cuts: list[int], *, seeded: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt through a fresh cache in chunks ending at ``cuts``: the last logits and the
    keys the layers cached for the prompt (``[layers, kv_heads, PROMPT_LENGTH, head_dim]``)."""
    prompt = _prompt(model)
    cache = KVCache(
        model.hparams, max_num_seqs=1, max_model_len=64, dtype=model.dtype, device=model.device
    )
    start = 0
    with torch.inference_mode():
        for stop in cuts:
            row = RowSpec(0, prompt[start:stop], start, stop == cuts[-1], batch_invariant=seeded)
            logits = model.forward(ForwardPlan.build([row], cache=cache), cache)
            start = stop
    blocks = list(cache.slot_blocks(0))
    positions = torch.cat(
        [torch.arange(b * KV_BLOCK_SIZE, (b + 1) * KV_BLOCK_SIZE) for b in blocks]
    )
    return logits[0].clone(), cache.keys[:, :, positions[:PROMPT_LENGTH]].clone()


@pytest.fixture(params=["float32", "bfloat16"])
def model(request: pytest.FixtureRequest) -> DecoderModel:
    shared = {"float32": "runner", "bfloat16": "bf16_runner"}[request.param]
    runner: ModelRunner = request.getfixturevalue(shared)
    return runner.model


@pytest.mark.parametrize(
    "cuts",
    [
        [20, 21, PROMPT_LENGTH],  # a one-token chunk between two others (decode-row attention)
        list(range(1, PROMPT_LENGTH + 1)),  # every token alone
        [7, 33, PROMPT_LENGTH],
    ],
    ids=["one-token chunk", "token by token", "uneven chunks"],
)
def test_a_seeded_prompt_caches_and_scores_the_same_however_it_is_cut(
    model: DecoderModel, cuts: list[int]
) -> None:
    whole_logits, whole_keys = _run(model, [PROMPT_LENGTH], seeded=True)
    cut_logits, cut_keys = _run(model, cuts, seeded=True)
    for layer in range(whole_keys.shape[0]):
        assert torch.equal(whole_keys[layer], cut_keys[layer]), f"layer {layer}'s keys differ"
    assert torch.equal(whole_logits, cut_logits)


def test_the_token_by_token_layout_computes_the_chunks_attention(runner: ModelRunner) -> None:
    """Seeded and unseeded, the same prompt in one chunk: the decode rows' layout (heads
    folded per KV head, the keys broadcast, a causal row per token) and SDPA's causal chunk
    give the same logits up to float32 rounding (a wrong head fold or mask would not)."""
    model = runner.model
    assert model.dtype == torch.float32 and model.fused_decode is None
    seeded, seeded_keys = _run(model, [PROMPT_LENGTH], seeded=True)
    unseeded, unseeded_keys = _run(model, [PROMPT_LENGTH], seeded=False)
    torch.testing.assert_close(unseeded, seeded, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(unseeded_keys, seeded_keys, rtol=1e-4, atol=1e-4)
