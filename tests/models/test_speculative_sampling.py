"""Verifying drafts keeps the model's distribution and the seeded draws (issue 32).

``sample_rows`` over a small vocabulary with fixed logits: the tokens a speculative row emits
must follow the target distribution (chi-square against it, position by position), and a
seeded slot must emit exactly the tokens plain one-token-a-step sampling draws, whatever the
draft, with its generator left where plain sampling leaves it.
"""

from __future__ import annotations

import pytest
import torch

from app.models.base import SamplingParams, StepRow
from app.models.sampling.sampler import Sampler, SampleRequest
from app.models.sampling.verification import sample_rows

VOCAB = 6
SLOTS = 64
# chi-square critical value, 5 degrees of freedom, p = 0.001: a correct sampler fails 1 in 1000
CHI2_5DOF_P001 = 20.52
LOGITS = torch.tensor(
    [
        [1.0, 0.2, -0.5, 0.8, -1.0, 0.0],  # position 0: where the draft's first token goes
        [-0.3, 1.2, 0.4, -0.8, 0.1, 0.6],  # position 1: after an accepted first token
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _speculative_trials(trials: int, draft: tuple[int, int], sampling: SamplingParams):
    """Emitted tokens of ``trials`` rows (each slot a fresh seed) verifying ``draft``."""
    sampler = Sampler(SLOTS, vocab_size=VOCAB)
    emitted: list[tuple[int, ...]] = []
    for batch in range(trials // SLOTS):
        rows = []
        for slot in range(SLOTS):
            seed = batch * SLOTS + slot
            sampler.start_sequence(slot, seed, sampling)
            rows.append(StepRow(slot, (5, *draft), 10, True, sampling, num_draft_tokens=2))
        logits = LOGITS.repeat(SLOTS, 1)
        for sample, row in zip(sample_rows(sampler, logits, rows), rows, strict=True):
            assert sample is not None
            emitted.append((*row.draft_token_ids[: sample.num_accepted], sample.token))
    return emitted


def test_accepted_tokens_follow_the_target_distribution():
    sampling = SamplingParams(temperature=1.0, seed=0)
    draft = (3, 1)  # probable first token, the most probable second
    emitted = _speculative_trials(8192, draft, sampling)
    probs = LOGITS.softmax(dim=-1)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=VOCAB).float()
    assert _chi_square(first, probs[0]) < CHI2_5DOF_P001
    # the token after an accepted first draft token follows position 1's distribution
    second = [e[1] for e in emitted if len(e) > 1]
    counts = torch.bincount(torch.tensor(second), minlength=VOCAB).float()
    assert _chi_square(counts, probs[1]) < CHI2_5DOF_P001
    # acceptance of the first drafted token happens with probability p(d)
    accepted = sum(e[0] == draft[0] for e in emitted) / len(emitted)
    assert abs(accepted - float(probs[0, draft[0]])) < 0.03


def test_a_rejected_draft_token_is_not_favoured_on_the_retry():
    """Always-accept or resample-from-p-including-d would both fail this: given rejection,
    the first token is never the drafted one."""
    sampling = SamplingParams(temperature=1.0, seed=0)
    emitted = _speculative_trials(2048, (0, 1), sampling)
    rejected = [e for e in emitted if len(e) == 1]
    assert rejected and all(e[0] != 0 for e in rejected)


def _plain(sampler: Sampler, slot: int, logits: list[torch.Tensor], sampling: SamplingParams):
    return [sampler.sample(row[None], [SampleRequest(slot, sampling)])[0] for row in logits]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.9, top_k=4, seed=123),
        SamplingParams(temperature=1.0, seed=123, logit_bias=((2, 1.5), (4, -2.0))),
        SamplingParams(temperature=0.0, seed=123, logit_bias=((1, 0.7),)),
    ],
)
def test_a_seeded_slot_emits_the_tokens_of_plain_sampling_whatever_the_draft(sampling):
    torch.manual_seed(7)
    steps = [torch.randn(VOCAB) * 2 for _ in range(40)]
    plain = Sampler(1, vocab_size=VOCAB)
    plain.start_sequence(0, 123, sampling)
    expected = _plain(plain, 0, steps, sampling)
    after = plain.generator_state(0)  # where plain sampling left the generator

    rng = torch.Generator().manual_seed(1)
    sampler = Sampler(1, vocab_size=VOCAB)
    sampler.start_sequence(0, 123, sampling)
    got: list[int] = []
    while len(got) < len(steps):
        k = min(int(torch.randint(0, 4, (1,), generator=rng)), len(steps) - len(got) - 1)
        truth = expected[len(got) : len(got) + k]
        # a draft that agrees with plain sampling for a while, then (maybe) not
        draft = tuple(t if torch.rand(1, generator=rng) < 0.7 else (t + 1) % VOCAB for t in truth)
        row = StepRow(0, (0, *draft), len(got), True, sampling, num_draft_tokens=k)
        logits = torch.stack(steps[len(got) : len(got) + k + 1])
        (sample,) = sample_rows(sampler, logits, [row])
        assert sample is not None
        got.extend((*draft[: sample.num_accepted], sample.token))
    assert got[: len(steps)] == expected
    assert torch.equal(sampler.generator_state(0), after)


def test_greedy_rows_accept_while_the_argmax_agrees():
    sampler = Sampler(1, vocab_size=VOCAB)
    greedy = SamplingParams(temperature=0.0)
    row = StepRow(0, (5, 0, 2), 3, True, greedy, num_draft_tokens=2)
    (sample,) = sample_rows(sampler, LOGITS, [row])
    assert sample is not None
    # argmax of position 0 is 0 (accepted), of position 1 is 1 (the draft said 2: rejected)
    assert (sample.num_accepted, sample.token) == (1, 1)
