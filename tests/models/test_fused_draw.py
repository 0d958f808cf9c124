"""The sampler's draw in one C loop (``fused_decode_sampling.c``) against the rules written out
in float64: an unfiltered row draws the inverse CDF's token in token-id order wherever the draw
is not within rounding of a boundary; a filtered row (top-k, top-p, min-p) draws only the kept
tokens, each with its share of the kept mass; never a token of zero weight; the rows it
cannot decide are left to torch's path."""

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
    logits: torch.Tensor,
    temperature: float,
    min_p: float,
    uniforms: list[float],
    *,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[int]:
    assert KERNELS is not None
    rows = len(uniforms)
    got = sample_rows(
        KERNELS,
        logits.expand(rows, -1).contiguous(),  # one row, many uniforms
        torch.full((rows,), temperature),
        torch.full((rows,), top_k),
        torch.full((rows,), top_p),
        torch.full((rows,), min_p),
        torch.tensor(uniforms),
        threads=2,
    )
    assert got is not None
    return got.tolist()


def kept_shares(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> dict[int, float]:
    """The filtered rule over the float64 sorted vocabulary: each kept token's share."""
    probs = (logits.double() / temperature).softmax(dim=-1)
    sorted_probs, ids = probs.sort(descending=True)
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p
    if top_k > 0:
        keep[top_k:] = False
    keep &= sorted_probs >= min_p * sorted_probs[0]
    keep[0] = True
    kept = sorted_probs * keep
    return {int(i): float(p) for i, p in zip(ids[keep], (kept / kept.sum())[keep], strict=True)}


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("vocab", "top_k", "top_p", "min_p"),
    [
        (1000, 0, 0.9, 0.0),
        (50_001, 0, 0.95, 0.0),
        (262_144, 0, 0.9, 0.0),
        (262_144, 40, 1.0, 0.0),
        (50_001, 40, 0.9, 0.05),
        (3000, 1, 1.0, 0.0),
        (3000, 5000, 0.5, 0.0),
    ],
)
def test_a_filtered_row_draws_the_kept_tokens_by_their_share(
    vocab: int, top_k: int, top_p: float, min_p: float, dtype: torch.dtype
) -> None:
    """Peaked and flat rows (the nucleus of a flat one is most of the vocabulary, where torch
    sorts all of it): 4,000 evenly spaced uniforms draw only kept tokens (or one tied with the
    cut: bfloat16 logits tie often, and which of a tie is first is either's choice), each
    about as often as its share of the kept mass (within 1.5 draws plus rounding), and every
    kept token of a share over 1/1000 at least once."""
    generator = torch.Generator().manual_seed(vocab + top_k)
    draws = 4000
    uniforms = [(i + 0.5) / draws for i in range(draws)]
    for temperature, scale in ((1.0, 3.0), (0.7, 0.3)):
        logits = (torch.randn(vocab, generator=generator) * scale).to(dtype)
        shares = kept_shares(logits.float(), temperature, top_k, top_p, min_p)
        got = draw(logits, temperature, min_p, uniforms, top_k=top_k, top_p=top_p)
        counts: dict[int, int] = {}
        for token in got:
            counts[token] = counts.get(token, 0) + 1
        probs = (logits.double() / temperature).softmax(dim=-1)
        cut = min(probs[token].item() for token in shares)  # a tie at the cut: either way
        assert all(t in shares or probs[t] >= cut * (1 - 1e-6) for t in counts), counts.keys()
        for token, share in shares.items():
            assert abs(counts.get(token, 0) - share * draws) <= 1.5 + 1e-4 * draws, token
            if share > 1e-3:
                assert token in counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.999), (30_000, 1.0)])
def test_a_cut_among_the_smallest_weights_keeps_them(
    top_k: int, top_p: float, dtype: torch.dtype
) -> None:
    """One token of weight 1 and 99,999 just under the histograms' floor (2^-24 of the best:
    summed, not counted, until a cut falls among them): top_p 0.999 and top_k 30,000 both cut
    in that tail, which then holds 0.1-0.3% of the kept mass, 2.5-6 of 2,000 draws. Drawing the
    best token every time (the tail left out) fails the best's count."""
    generator = torch.Generator().manual_seed(top_k)
    vocab, draws = 100_000, 2000
    logits = torch.full((vocab,), -17.0) + torch.rand(vocab, generator=generator) * 0.05
    logits[1234] = 0.0
    logits = logits.to(dtype)
    uniforms = [(i + 0.5) / draws for i in range(draws)]
    shares = kept_shares(logits.float(), 1.0, top_k, top_p, 0.0)
    assert 0.99 < shares[1234] < 0.999  # the tail's share is large enough to see
    got = draw(logits, 1.0, 0.0, uniforms, top_k=top_k, top_p=top_p)
    probs = logits.double().softmax(dim=-1)
    cut = min(probs[token].item() for token in shares)
    assert all(t in shares or probs[t] >= cut * (1 - 1e-6) for t in got)
    assert abs(got.count(1234) - shares[1234] * draws) <= 1.5 + 1e-4 * draws


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_rows_whose_largest_logit_is_not_finite_go_to_torch(dtype: torch.dtype) -> None:
    """A NaN or +inf anywhere in a row: in the vector maxima's paired loads, their single
    loads and the tail of a 300-column row (AVX-512: 32 at a time, then 16, then the rest;
    AVX2: 8, then one at a time)."""
    assert KERNELS is not None
    logits = torch.randn(4, 300).to(dtype)
    ones, zeros, halves = torch.ones(4), torch.zeros(4), torch.full((4,), 0.5)
    for top_k, top_p in ((zeros, ones), (zeros + 3, halves)):
        args = (ones, top_k, top_p, zeros, halves)
        assert sample_rows(KERNELS, logits, *args) is not None
        for bad in (float("nan"), float("inf")):
            for column in (0, 17, 40, 287, 291, 299):
                odd = logits.clone()
                odd[2, column] = bad
                assert sample_rows(KERNELS, odd, *args) is None, (bad, column)
        odd = logits.clone()
        odd[1] = float("-inf")
        assert sample_rows(KERNELS, odd, *args) is None
    with pytest.raises(ValueError):
        sample_rows(KERNELS, logits.half(), ones, zeros, ones, zeros, halves)
    with pytest.raises(ValueError):
        sample_rows(KERNELS, logits, ones[:3], zeros, ones, zeros, halves)


def test_the_sampler_draws_every_random_row_there() -> None:
    """A batch of unfiltered, nucleus, greedy, min_p and top-k rows: with the C draw, the
    sampler hands it the step's random rows in one call; the unfiltered rows take the same
    tokens as torch's path (no draw here falls within rounding of a boundary), the filtered
    ones kept tokens of theirs, the greedy row its argmax; each row still draws one uniform
    from its own generator. A step with a row the draw cannot decide (a NaN) goes through
    torch's path whole."""
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
        samplers = [Sampler(len(params)), Sampler(len(params), draw=counted)]
        for sampler in samplers:
            for slot, p in enumerate(params):
                sampler.start_sequence(slot, p.seed)
        requests = [SampleRequest(slot, p) for slot, p in enumerate(params)]
        for _ in range(2):  # the generators move on by one draw a row
            torch_path, fused_path = (sampler.sample(logits, requests) for sampler in samplers)
            same = range(len(params)) if step == 2 else (0, 2, 3, 5)
            assert [fused_path[i] for i in same] == [torch_path[i] for i in same], step
            for i in (1, 4):
                p = params[i]
                assert fused_path[i] in kept_shares(logits[i], p.temperature, p.top_k, p.top_p, 0)
            for slot in range(len(params)):
                states = [sampler.generator_state(slot) for sampler in samplers]
                assert torch.equal(*states)
    assert calls == [5] * 6  # every random row, in one call a step
