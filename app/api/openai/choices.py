"""``n`` > 1 on the /v1 endpoints: one prompt, ``n`` sequences, one answer with choices
``0..n-1``.

The group lives at the edge: choice ``i`` is its own ``GenerationRequest`` (id
``<id>`` for choice 0, ``<id>-<i>`` after it; seed ``seed + i`` when the client chose one, else
a random seed each), submitted together and all or none (the queue must hold all ``n``, and
the scheduler admits a group's sequences into slots together: ``GenerationRequest.group_id``).
Sequences with one prompt share its prefill where the model caches prefixes. Each choice is
written by its own answer format (its index, its logprobs' text offsets); the answer's usage
counts the prompt once and the tokens of every choice, as OpenAI's does.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import replace

from sse_starlette import ServerSentEvent

from app.api.openai.answers import ChatAnswer, CompletionAnswer
from app.api.openai.responses import Usage
from app.api.request_builder import SEED_BITS
from app.engine.request import FinalEvent, GenerationRequest

ChoiceFormat = CompletionAnswer | ChatAnswer


def choice_requests(generation: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The ``n`` requests of a group: choice 0 is ``generation`` itself (group-tagged)."""
    sampling = generation.sampling
    requests = []
    for index in range(n):
        if index == 0:
            seed = sampling.seed
        elif sampling.batch_invariant:  # the client's seed: seed + i (API.md)
            seed = (sampling.seed + index) % (1 << SEED_BITS)
        else:
            seed = secrets.randbits(SEED_BITS)
        requests.append(
            replace(
                generation,
                request_id=generation.request_id
                if index == 0
                else f"{generation.request_id}-{index}",
                sampling=replace(sampling, seed=seed),
                group_id=generation.request_id,
            )
        )
    return requests


def merged_body(formats: Sequence[ChoiceFormat], finals: Sequence[FinalEvent]) -> dict[str, object]:
    """One answer whose choices are every choice's, in index order; usage over all."""
    bodies = [fmt.response(final) for fmt, final in zip(formats, finals, strict=True)]
    merged = dict(bodies[0])
    merged["choices"] = [choice for body in bodies for choice in body["choices"]]  # type: ignore[union-attr]
    merged["usage"] = group_usage(finals).model_dump()
    return merged


def group_usage(finals: Sequence[FinalEvent]) -> Usage:
    prompt = finals[0].prompt_tokens
    completion = sum(final.completion_tokens for final in finals)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def group_answer(
    formats: Sequence[ChoiceFormat], include_usage: bool
) -> tuple[
    Callable[[Sequence[FinalEvent]], dict[str, object]],
    Callable[[Sequence[FinalEvent]], list[ServerSentEvent]] | None,
]:
    """``app.api.answers.answer``'s ``body`` and ``trailer`` for ``n`` > 1: the JSON body merges
    every choice's (``merged_body``); a stream ends with one usage chunk over all when asked."""

    def usage(finals: Sequence[FinalEvent]) -> list[ServerSentEvent]:
        return [formats[0].usage_event(group_usage(finals))]

    return (lambda finals: merged_body(formats, finals)), (usage if include_usage else None)
