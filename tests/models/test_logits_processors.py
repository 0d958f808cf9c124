"""Each logits processor against transformers' processors or the formula written out here, on
the same float32 logits, and the whole pipeline's batch invariance with every processor on."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from app.models.base import SamplingParams
from app.models.sampling.logits_processors import (
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
)
from app.models.sampling.sampler import Sampler, SampleRequest
from app.models.sampling.token_counts import SlotTokenCounts

VOCAB = 1000
EOS = frozenset({2})


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _state(params: SamplingParams, prompt: list[int], generated: list[int]) -> SlotTokenCounts:
    state = SlotTokenCounts.start(params, VOCAB, eos_token_ids=EOS)
    state.feed(prompt)
    for token in generated:
        state.drawn(token)
    return state


PROMPT = [5, 6, 7, 7, 900]
GENERATED = [7, 8, 8, 8, 999, 5]


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_transformers(penalty: float) -> None:
    logits = _logits(2)
    params = SamplingParams(repetition_penalty=penalty)
    states = [_state(params, PROMPT, GENERATED), _state(SamplingParams(), PROMPT, GENERATED)]
    got = logits.clone()
    apply_penalties(got, states)
    want = RepetitionPenaltyLogitsProcessor(penalty)(
        torch.tensor([PROMPT + GENERATED]), logits[:1].clone()
    )
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], logits[1])  # a row without penalties is untouched


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = _logits(1)
    presence, frequency = 0.6, 0.25
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    got = logits.clone()
    apply_penalties(got, [_state(params, PROMPT, GENERATED)])
    want = logits.clone()[0]
    for token in set(GENERATED):  # OpenAI: mu[j] - c[j] * a_freq - (c[j] > 0) * a_pres
        count = GENERATED.count(token)
        want[token] = want[token] - count * frequency - presence
    assert torch.allclose(got[0], want, atol=1e-6)
    assert got[0, 6] == logits[0, 6]  # a prompt-only token: not penalised (generated only)


def test_logit_bias_is_added() -> None:
    logits = _logits(3)
    bias = ((4, 100.0), (10, -100.0), (999, 0.5))
    states = [_state(SamplingParams(logit_bias=bias), [], []), _state(SamplingParams(), [], [])]
    states.append(_state(SamplingParams(logit_bias=((4, -1.0),)), [], []))
    got = logits.clone()
    apply_logit_bias(got, states)
    want = logits.clone()
    for token, value in bias:
        want[0, token] += value
    want[2, 4] -= 1.0
    assert torch.equal(got, want)


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(min_tokens=3, min_tokens_token_ids=(11,))
    state = _state(params, PROMPT, [])
    for generated in range(5):
        logits = _logits(1, seed=generated)
        got = logits.clone()
        apply_min_tokens(got, [state])
        masked = {int(t) for t in torch.nonzero(got[0] == float("-inf"))}
        assert masked == ({2, 11} if generated < 3 else set())
        state.drawn(20)


def _reference_pick(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """transformers' warpers in API.md's order, then the sampler's inverse-CDF rule."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        warpers.append(MinPLogitsWarper(params.min_p))
    probs = warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0].softmax(-1)
    if params.top_k == 0 and params.top_p >= 1.0:  # token-id order
        ids = torch.arange(VOCAB)
    else:
        probs, ids = probs.sort(descending=True)
    cdf = probs.cumsum(-1)
    pick = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()]), right=True))
    return int(ids[min(pick, VOCAB - 1)])


WARPED = [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_k=20, seed=2),
    SamplingParams(temperature=1.2, top_p=0.8, seed=3),
    SamplingParams(temperature=1.0, min_p=0.1, seed=4),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05, seed=5),
    SamplingParams(temperature=1.5, top_p=0.95, min_p=0.2, seed=6),
]


def test_temperature_top_k_top_p_min_p_equal_transformers_warpers() -> None:
    for trial in range(20):
        logits = _logits(len(WARPED), seed=100 + trial)
        sampler = Sampler(len(WARPED), vocab_size=VOCAB)
        requests = []
        for slot, params in enumerate(WARPED):
            sampler.start_sequence(slot, params.seed + trial, params)
            requests.append(SampleRequest(slot, params))
        got = sampler.sample(logits, requests)
        for row, params in enumerate(WARPED):
            u = torch.rand(1, generator=torch.Generator().manual_seed(params.seed + trial))
            assert got[row] == _reference_pick(logits[row], params, u.item()), (trial, params)


EVERYTHING = SamplingParams(
    temperature=0.9,
    top_k=40,
    top_p=0.9,
    min_p=0.02,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    repetition_penalty=1.2,
    min_tokens=3,
    min_tokens_token_ids=(9,),
    logit_bias=((3, 5.0), (4, -5.0)),
    seed=77,
    batch_invariant=True,
)


def test_a_row_with_every_processor_does_not_depend_on_its_neighbours() -> None:
    generator = torch.Generator().manual_seed(3)
    neighbours = [
        SamplingParams(temperature=1.0, seed=1, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logit_bias=((7, 3.0),)),
        SamplingParams(temperature=1.3, top_p=0.5, min_p=0.3, seed=2, frequency_penalty=1.0),
        SamplingParams(temperature=0.8, seed=3),
    ]
    alone = Sampler(8, vocab_size=VOCAB, eos_token_ids=EOS)
    crowd = Sampler(8, vocab_size=VOCAB, eos_token_ids=EOS)
    alone.start_sequence(5, EVERYTHING.seed, EVERYTHING)
    alone.feed(5, PROMPT)
    crowd.start_sequence(5, EVERYTHING.seed, EVERYTHING)
    crowd.feed(5, PROMPT)
    for slot, params in enumerate(neighbours):
        crowd.start_sequence(slot, params.seed, params)
        crowd.feed(slot, [slot, slot + 1])
    requests = [SampleRequest(slot, p) for slot, p in enumerate(neighbours)]
    requests.insert(2, SampleRequest(5, EVERYTHING))
    mine = []
    for _ in range(12):
        row = torch.randn(1, VOCAB, generator=generator) * 3
        others = torch.randn(len(neighbours), VOCAB, generator=generator) * 3
        in_crowd = crowd.sample(torch.cat([others[:2], row, others[2:]]), requests)[2]
        by_itself = alone.sample(row, [SampleRequest(5, EVERYTHING)])[0]
        assert in_crowd == by_itself
        mine.append(by_itself)
    assert len(set(mine)) > 1
    assert not {2, 9} & set(mine[:3])  # min_tokens held EOS and the stop id back


def test_unprocessed_rows_leave_the_logits_raw() -> None:
    logits = _logits(2)
    raw = logits.clone()
    sampler = Sampler(2, vocab_size=VOCAB, eos_token_ids=EOS)
    sampler.start_sequence(0, 1, EVERYTHING)
    sampler.start_sequence(1, 2, SamplingParams(temperature=0.0))
    sampler.sample(logits, [SampleRequest(0, EVERYTHING), SampleRequest(1, SamplingParams(0.0))])
    assert torch.equal(logits, raw)


def _dense_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int]
) -> torch.Tensor:
    """The three penalties over a whole row, as one dense ``[vocab]`` pass each."""
    counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=VOCAB)
    seen = counts > 0
    seen[prompt] = True
    row = logits.clone()
    r = torch.tensor(params.repetition_penalty)
    row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
    row = row - counts.to(torch.int32) * torch.tensor(params.frequency_penalty)
    return row - (counts > 0) * torch.tensor(params.presence_penalty)


def test_penalties_on_the_seen_ids_equal_the_dense_formulas_bit_for_bit() -> None:
    """Rows of every mix of penalties (negative ones, repetition below 1, a long prompt that
    grows the per-slot arrays, zero and infinite logits) against the whole-row formulas."""
    generator = torch.Generator().manual_seed(11)
    mixes = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=-0.7),
        SamplingParams(frequency_penalty=1.1),
        SamplingParams(repetition_penalty=0.6, presence_penalty=0.4, frequency_penalty=-0.3),
        SamplingParams(),  # no penalty: untouched
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.05),
    ]
    histories = []
    for index in range(len(mixes)):
        length = 700 if index % 2 else 9  # past the arrays' initial capacity, and short
        prompt = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        generated = torch.randint(0, 40, (30,), generator=generator).tolist()
        histories.append((prompt, generated + prompt[:5]))
    logits = _logits(len(mixes), seed=12)
    logits[0, histories[0][0][0]] = 0.0
    logits[1, histories[1][1][0]] = float("-inf")
    logits[3, histories[3][1][1]] = float("inf")
    states = [_state(p, *history) for p, history in zip(mixes, histories, strict=True)]
    got = logits.clone()
    apply_penalties(got, states)
    for row, (params, (prompt, generated)) in enumerate(zip(mixes, histories, strict=True)):
        want = _dense_penalties(logits[row], params, prompt, generated)
        assert torch.equal(got[row], want), params


def test_seen_tokens_count_the_generated_ids_and_keep_the_prompt_ids() -> None:
    state = _state(SamplingParams(presence_penalty=1.0), [3, 3, 4], [4, 5, 5, 5])
    seen = state.seen
    assert seen is not None
    assert dict(zip(seen.ids.tolist(), seen.generated_counts.tolist(), strict=True)) == {
        3: 0.0,
        4: 1.0,
        5: 3.0,
    }
    state.feed([6])  # after the first draw a fed token is the one drawn last step
    assert 6 not in seen.ids.tolist()
    state.resume([6, 6])
    assert seen.ids.tolist() == [3, 4, 5, 6] and seen.generated_counts[-1] == 2.0
    assert state.generated == 6


def test_a_token_outside_the_vocabulary_is_refused() -> None:
    state = _state(SamplingParams(repetition_penalty=1.2), [1, 2], [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.feed([VOCAB])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.drawn(-1)
    assert state.seen is not None and state.seen.ids.tolist() == [1, 2]
    with pytest.raises(ValueError, match="vocabulary size"):
        SlotTokenCounts.start(SamplingParams(presence_penalty=0.5), 0)
