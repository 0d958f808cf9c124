"""The sampler against a plain full-sort reference, and its per-slot reproducibility."""

from __future__ import annotations

import pytest
import torch

from app.models.base import SamplingParams
from app.models.sampling.sampler import Sampler, SampleRequest

VOCAB = 49152


def _reference(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """The rule written out over the fully sorted vocabulary, one row at a time."""
    scaled = logits / params.temperature
    probs = scaled.softmax(dim=-1)
    if params.top_k == 0 and params.top_p >= 1.0:  # unfiltered: token-id order
        cdf = probs.cumsum(dim=-1)
        return int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()]), right=True))
    sorted_probs, ids = probs.sort(descending=True)
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < params.top_p
    if params.top_k > 0:
        keep[params.top_k :] = False
    keep[0] = True
    cdf = (sorted_probs * keep).cumsum(dim=-1)
    pick = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()]), right=True))
    return int(ids[min(pick, VOCAB - 1)])


def _uniform(seed: int) -> float:
    return torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()


PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    SamplingParams(temperature=1.0, seed=2),
    SamplingParams(temperature=1.3, top_k=40, seed=3),
    SamplingParams(temperature=0.7, top_k=500, top_p=0.95, seed=4),
    SamplingParams(temperature=5.0, top_p=0.6, seed=5),  # flat: nucleus beyond 256 candidates
    SamplingParams(temperature=0.5, top_k=1, seed=6),
]


def test_matches_the_full_sort_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAMS), VOCAB, generator=generator) * 4
    sampler = Sampler(len(PARAMS))
    requests = []
    for slot, params in enumerate(PARAMS):
        sampler.start_sequence(slot, params.seed)
        requests.append(SampleRequest(slot, params))
    got = sampler.sample(logits, requests)
    want = [_reference(logits[i], p, _uniform(p.seed)) for i, p in enumerate(PARAMS)]
    assert got == want
    assert got[-1] == int(logits[-1].argmax())  # top_k=1 is greedy


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(3, 100)
    requests = [SampleRequest(i, SamplingParams(temperature=0.0)) for i in range(3)]
    assert Sampler(3).sample(logits, requests) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p, allowed", [(0.5, {0}), (0.8, {0, 1})])
def test_top_p_keeps_only_the_nucleus(top_p: float, allowed: set[int]) -> None:
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log()
    sampler = Sampler(1)
    seen = set()
    for seed in range(200):
        sampler.start_sequence(0, seed)
        seen |= set(sampler.sample(logits, [SampleRequest(0, SamplingParams(1.0, top_p))]))
    assert seen == allowed


def test_a_row_does_not_depend_on_its_neighbours() -> None:
    generator = torch.Generator().manual_seed(1)
    row = torch.randn(1, VOCAB, generator=generator)
    others = torch.randn(5, VOCAB, generator=generator)
    mine = SamplingParams(temperature=0.8, top_p=0.9, seed=7)

    alone = Sampler(8)
    alone.start_sequence(2, 7)
    crowd = Sampler(8)
    crowd_requests = []
    for slot, params in enumerate([*PARAMS[:2], mine, *PARAMS[2:5]]):
        crowd.start_sequence(slot, params.seed)
        crowd_requests.append(SampleRequest(slot, params))
    for _ in range(5):  # several draws: the generators advance one draw per token
        logits = torch.cat([others[:2], row, others[2:]])
        assert (
            crowd.sample(logits, crowd_requests)[2]
            == alone.sample(row, [SampleRequest(2, mine)])[0]
        )
