"""The sampler's draw from the whole vocabulary in one C loop (``fused_decode_sampling.c``)
against the inverse CDF written out in float64: the same token wherever the draw is not
within rounding of a boundary, never a token of zero weight, and the rows it cannot decide
left to torch's path."""

from __future__ import annotations

import pytest
import torch

from app.models.base import SamplingParams
from app.models.kernels.fused_decode import load_fused_decode
from app.models.sampling.fused_draw import sample_rows, vocabulary_draw
from app.models.sampling.sampler import Sampler, SampleRequest

KERNELS, HOW = load_fused_decode()
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"fused kernels: {HOW}")


def cumulative(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """The float64 cumulative weights of a row in token-id order, min_p's cut applied."""
    weights = (logits.double() / temperature).softmax(dim=-1)
    return weights.masked_fill(weights < min_p * weights.max(), 0.0).cumsum(dim=-1)


def reference(cdf: torch.Tensor, u: float) -> tuple[int, float]:
    """The first column whose cumulative weight exceeds ``u`` times the total, and how far
    (relative to the total) the target lies from the nearest boundary."""
    target = u * cdf[-1].item()
    pick = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True))
    return min(pick, cdf.shape[-1] - 1), (cdf - target).abs().min().item() / cdf[-1].item()


def draw(
    logits: torch.Tensor, temperature: float, min_p: float, uniforms: list[float]
) -> list[int]:
    assert KERNELS is not None
    rows = logits.expand(len(uniforms), -1)  # one row, many uniforms (a row stride of 0)
    got = sample_rows(
        KERNELS,
        rows.contiguous(),
        torch.full((len(uniforms),), temperature),
        torch.full((len(uniforms),), min_p),
        torch.tensor(uniforms),
        threads=2,
    )
    assert got is not None
    return got.tolist()


@pytest.mark.parametrize("vocab", [7, 1000, 50_001, 262_144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_draw_is_the_inverse_cdf_in_token_order(vocab: int, dtype: torch.dtype) -> None:
    """Vocabularies under one block, of several blocks with a tail, and Gemma 3's; peaked and
    flat rows (temperatures 0.3 to 2), min_p off and on: each of 64 uniforms draws the float64
    reference's token unless its target lies within 1e-5 of the total from a boundary."""
    generator = torch.Generator().manual_seed(vocab)
    uniforms = torch.rand(64, generator=generator).tolist() + [0.0, 0.999999]
    for temperature, min_p in ((1.0, 0.0), (0.3, 0.0), (2.0, 0.0), (0.8, 0.05)):
        logits = (torch.randn(vocab, generator=generator) * 3).to(dtype)
        got = draw(logits, temperature, min_p, uniforms)
        cdf = cumulative(logits.float(), temperature, min_p)
        weights = cdf.diff(prepend=cdf.new_zeros(1))
        for u, token in zip(uniforms, got, strict=True):
            want, gap = reference(cdf, u)
            assert token == want or gap < 1e-5, (vocab, temperature, min_p, u, token, want)
            assert weights[token] > 0  # never a token of no weight (min_p's cut)


def test_masked_tokens_are_never_drawn() -> None:
    """A constraint's -inf and a min_p cut leave weight 0: across the whole range of u only
    the allowed tokens come out, each where its share of the mass says."""
    logits = torch.full((50_000,), float("-inf"))
    allowed = {3: 0.0, 20_000: 1.0, 49_999: 2.0}
    for token, value in allowed.items():
        logits[token] = value
    uniforms = [i / 1000 for i in range(1000)]
    got = draw(logits, 1.0, 0.0, uniforms)
    assert set(got) == set(allowed)
    weights = torch.tensor(list(allowed.values())).exp()
    shares = (weights / weights.sum()).tolist()
    for token, share in zip(allowed, shares, strict=True):
        assert abs(got.count(token) / 1000 - share) < 0.002
    logits[10] = 1.9  # min_p 0.5 of the best's weight keeps 49,999 (e^2) and 10 (e^1.9) only
    assert set(draw(logits, 1.0, 0.5, uniforms)) == {10, 49_999}


def test_rows_whose_largest_logit_is_not_finite_go_to_torch() -> None:
    assert KERNELS is not None
    logits = torch.randn(4, 300)
    ones, zeros, halves = torch.ones(4), torch.zeros(4), torch.full((4,), 0.5)
    assert sample_rows(KERNELS, logits, ones, zeros, halves) is not None
    for bad in (float("nan"), float("inf")):
        odd = logits.clone()
        odd[2, 17] = bad
        assert sample_rows(KERNELS, odd, ones, zeros, halves) is None
    odd = logits.clone()
    odd[1] = float("-inf")
    assert sample_rows(KERNELS, odd, ones, zeros, halves) is None
    with pytest.raises(ValueError):
        sample_rows(KERNELS, logits.half(), ones, zeros, halves)
    with pytest.raises(ValueError):
        sample_rows(KERNELS, logits, ones[:3], zeros, halves)


def test_the_sampler_draws_its_unfiltered_rows_there_and_the_rest_as_before() -> None:
    """A batch of unfiltered, filtered, greedy and min_p rows: the sampler with the C draw takes
    the same tokens as without it (no draw here falls within rounding of a boundary), each row
    still draws one uniform from its own generator, and only the unfiltered rows reach the
    draw; a row it cannot decide (a NaN) goes through torch's path."""
    params = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.8, top_p=0.9, seed=2),
        SamplingParams(temperature=0.0, seed=3),
        SamplingParams(temperature=1.2, min_p=0.05, seed=4),
        SamplingParams(temperature=0.7, top_k=40, seed=5),
        SamplingParams(temperature=0.6, seed=6),
    ]
    calls: list[int] = []
    fused = vocabulary_draw(KERNELS)
    assert fused is not None

    def counted(*args: torch.Tensor) -> torch.Tensor | None:
        calls.append(args[0].shape[0])
        return fused(*args)

    generator = torch.Generator().manual_seed(7)
    for step in range(3):
        logits = torch.randn(len(params), 49_152, generator=generator) * 4
        if step == 2:
            logits[5, 100] = float("nan")
        tokens = []
        for draw_with in (None, counted):
            sampler = Sampler(len(params), draw=draw_with)
            for slot, p in enumerate(params):
                sampler.start_sequence(slot, p.seed)
            requests = [SampleRequest(slot, p) for slot, p in enumerate(params)]
            tokens.append(sampler.sample(logits, requests))
            tokens.append(sampler.sample(logits, requests))  # the generators moved on by one
        assert tokens[0] == tokens[2] and tokens[1] == tokens[3], step
    assert calls == [3, 3, 3, 3, 3, 3]  # rows 0, 3 and 5
