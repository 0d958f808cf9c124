"""apply_token_masks against a bit-by-bit reference of llguidance's bitmask layout."""

from __future__ import annotations

import pytest
import torch

from app.models.base import SamplingParams
from app.models.sampling.sampler import Sampler, SampleRequest
from app.models.sampling.token_mask import apply_token_masks, mask_words


def _mask(allowed: set[int], vocab: int) -> torch.Tensor:
    """Words with bit j of word w set for each allowed token 32*w + j (two's complement int32)."""
    words = [0] * mask_words(vocab)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _reference(row: torch.Tensor, allowed: set[int]) -> torch.Tensor:
    out = row.clone()
    for token in range(row.shape[0]):
        if token not in allowed:
            out[token] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [64, 100, 1000])
def test_masked_rows_match_the_reference_and_others_are_untouched(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=generator)
    original = logits.clone()
    allowed = [
        {0, 31, 32, 63, vocab - 1},  # word edges, bit 31 (the sign bit), the last token
        set(range(0, vocab, 3)),
    ]
    masks = [_mask(allowed[0], vocab), None, _mask(allowed[1], vocab), None]
    apply_token_masks(logits, masks)
    assert torch.equal(logits[0], _reference(original[0], allowed[0]))
    assert torch.equal(logits[2], _reference(original[2], allowed[1]))
    assert torch.equal(logits[1], original[1])
    assert torch.equal(logits[3], original[3])


def test_no_mask_is_a_no_op() -> None:
    logits = torch.randn(3, 50)
    before = logits.clone()
    apply_token_masks(logits, [None, None, None])
    assert torch.equal(logits, before)


def test_a_mask_of_the_wrong_size_is_refused() -> None:
    logits = torch.randn(1, 100)
    with pytest.raises(ValueError, match="expected int32"):
        apply_token_masks(logits, [torch.zeros(3, dtype=torch.int32)])
    with pytest.raises(ValueError, match="1 rows"):
        apply_token_masks(logits, [None, None])


def test_the_sampler_draws_only_allowed_tokens_greedy_and_random() -> None:
    vocab = 300
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    allowed = {5, 77, 250}
    sampler = Sampler(2)
    for seed in range(20):
        sampler.start_sequence(1, seed)
        requests = [
            SampleRequest(0, SamplingParams(temperature=0.0), _mask(allowed, vocab)),
            SampleRequest(1, SamplingParams(temperature=2.0, seed=seed), _mask(allowed, vocab)),
        ]
        raw = logits.clone()
        greedy, drawn = sampler.sample(logits, requests)
        assert torch.equal(logits, raw)  # the model's logits are not modified
        assert greedy == max(allowed, key=lambda t: logits[0, t].item())
        assert drawn in allowed
