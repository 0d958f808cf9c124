"""The sampler's cost per step (``app.models.sampling.sampler.Sampler.sample``) with and without
logits
processors, at several batch sizes, on bfloat16 logits of SmolLM2's vocabulary shaped like a
language model's (``_logits``): what a step of the real model hands the sampler.

Configurations, all measured in one process and interleaved (each trial runs every
configuration once, in rotating order, so a noisy neighbour hits them alike):

* ``bare``: what the sampler did before the logits processors existed: the argmax of every
  row, a float32 copy, the draw (``Sampler._sample_random``);
* ``plain``: ``sample`` on rows that use no processor (temperature 1, top_p 0.95): the
  pipeline's cost to rows that do not use it is ``plain / bare``;
* ``processors``: every row with logit_bias (8 ids), presence, frequency and repetition
  penalties, min_tokens and min_p: ``processors / plain``;
* ``greedy`` and ``greedy+penalties``: temperature 0 without and with the repetition penalty.

Each row's history is a prompt of ``prompt_tokens`` random ids and ``GENERATED`` generated ones
(random ids: nearly all distinct, a worst case for the penalties, whose cost is the number of
distinct ids a row has seen). The two penalised configurations are timed at every prompt
length asked for, named ``processors@1500`` and so on for all but the first.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from app.models.base import SamplingParams
from app.models.sampling.sampler import Sampler, SampleRequest, argmax_rows

VOCAB = 49152
GENERATED = 64

PLAIN = SamplingParams(temperature=1.0, top_p=0.95)
PROCESSORS = SamplingParams(
    temperature=1.0,
    top_p=0.95,
    min_p=0.02,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.2,
    min_tokens=10_000,
    logit_bias=tuple((7 * i, 1.5) for i in range(8)),
)
GREEDY = SamplingParams(temperature=0.0)
GREEDY_PENALTIES = SamplingParams(temperature=0.0, repetition_penalty=1.3)
CONFIGS = {
    "bare": PLAIN,
    "plain": PLAIN,
    "processors": PROCESSORS,
    "greedy": GREEDY,
    "greedy+penalties": GREEDY_PENALTIES,
}


@dataclass(frozen=True, slots=True)
class SamplerCost:
    """Median ms per ``sample`` call of each configuration at one batch size.

    ``median_ms`` is keyed by configuration, the penalised ones at a prompt length other than
    the first suffixed ``@<prompt tokens>``."""

    rows: int
    prompt_tokens: tuple[int, ...]
    median_ms: dict[str, float]

    def ratio(self, a: str, b: str) -> float:
        return self.median_ms[a] / self.median_ms[b]


def _sampler(
    rows: int, params: SamplingParams, prompt_tokens: int
) -> tuple[Sampler, list[SampleRequest]]:
    sampler = Sampler(rows, vocab_size=VOCAB, eos_token_ids=frozenset({0, 2}))
    generator = torch.Generator().manual_seed(rows)
    requests = []
    for slot in range(rows):
        sampler.start_sequence(slot, slot, params)
        history = torch.randint(0, VOCAB, (prompt_tokens + GENERATED,), generator=generator)
        sampler.feed(slot, history[:prompt_tokens].tolist())  # the prompt
        # and what was generated, counted as a recomputed sequence's would be
        sampler.resume(slot, history[prompt_tokens:].tolist(), draws=0)
        requests.append(SampleRequest(slot, params))
    return sampler, requests


def _logits(rows: int) -> torch.Tensor:
    """bfloat16 ``[rows, VOCAB]`` logits shaped like a language model's: a flat floor and a
    few dozen likely tokens per row holding most of the mass (so top_p 0.95 is decided
    inside the sampler's 256 candidates, as on the real model's logits)."""
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, VOCAB, generator=generator) * 2
    likely = torch.randint(0, VOCAB, (rows, 32), generator=generator)
    logits.scatter_add_(1, likely, torch.linspace(26.0, 12.0, 32).expand(rows, 32).contiguous())
    return logits.to(torch.bfloat16)


def _setups(
    rows: int, prompt_tokens: tuple[int, ...]
) -> dict[str, tuple[Sampler, list[SampleRequest]]]:
    """Every configuration's sampler and requests, named as in ``SamplerCost.median_ms``."""
    first = prompt_tokens[0]
    setups = {name: _sampler(rows, params, first) for name, params in CONFIGS.items()}
    for length in prompt_tokens[1:]:
        for name in ("processors", "greedy+penalties"):
            setups[f"{name}@{length}"] = _sampler(rows, CONFIGS[name], length)
    return setups


def measure_sampler_cost(
    rows_list: list[int], trials: int, steps: int, prompt_tokens: tuple[int, ...] = (20,)
) -> list[SamplerCost]:
    """Median milliseconds per ``sample`` call of each configuration at each batch size."""
    results = []
    for rows in rows_list:
        logits = _logits(rows)
        setups = _setups(rows, prompt_tokens)
        names = list(setups)
        timings: dict[str, list[float]] = {name: [] for name in names}
        for trial in range(trials + 1):  # the first round warms up
            order = names[trial % len(names) :] + names[: trial % len(names)]
            for name in order:
                sampler, requests = setups[name]
                started = time.perf_counter()
                for _ in range(steps):
                    if name == "bare":  # the sampler before the pipeline: argmax, copy, draw
                        argmax_rows(logits)
                        sampler._sample_random(logits.float(), requests)
                    else:
                        sampler.sample(logits, requests)
                elapsed = (time.perf_counter() - started) / steps * 1000.0
                if trial:
                    timings[name].append(elapsed)
        results.append(
            SamplerCost(
                rows, prompt_tokens, {name: statistics.median(t) for name, t in timings.items()}
            )
        )
    return results
