"""The answers of ``/v1/completions`` and ``/v1/chat/completions``: their plans (one choice, or
``n``), each choice's answer format, and what is OpenAI's about ``n`` > 1.

``n`` > 1: one prompt, ``n`` sequences, one answer with choices ``0..n-1``. The group lives at
the edge: choice ``i`` is its own ``GenerationRequest`` (id
``<id>`` for choice 0, ``<id>-<i>`` after it; seed ``seed + i`` when the client chose one, else
a random seed each), submitted together and all or none (the queue must hold all ``n``, and
the scheduler admits a group's sequences into slots together: ``GenerationRequest.group_id``).
Sequences with one prompt share its prefill where the model caches prefixes. Each choice is
written by its own answer format (its index, its logprobs' text offsets); the answer's usage
counts the prompt once and the tokens of every choice, as OpenAI's does.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from sse_starlette import ServerSentEvent

from app.api.answers import AnswerPlan
from app.api.errors import APIError
from app.api.openai.answers import ChatAnswer, CompletionAnswer
from app.api.openai.logprobs import LogprobsWriter
from app.api.openai.responses import Usage
from app.api.openai.schemas import (
    ChatCompletionRequestBody,
    CompletionRequestBody,
    OpenAIRequestBody,
)
from app.api.request_builder import SEED_BITS, RequestOrigin
from app.api.resources import ServerResources
from app.engine.request import FinalEvent, GenerationRequest

ChoiceFormat = CompletionAnswer | ChatAnswer


async def completion_plan(
    body: CompletionRequestBody, origin: RequestOrigin, resources: ServerResources
) -> AnswerPlan:
    """``/v1/completions``' answer to ``body``: ``choice_plan`` in ``CompletionAnswer``."""
    return await choice_plan(CompletionAnswer, body, origin, resources)


async def chat_plan(
    body: ChatCompletionRequestBody, origin: RequestOrigin, resources: ServerResources
) -> AnswerPlan:
    """``/v1/chat/completions``' answer to ``body``: ``choice_plan`` in ``ChatAnswer``."""
    return await choice_plan(ChatAnswer, body, origin, resources)


async def choice_plan(
    answer_format: type[ChoiceFormat],
    body: OpenAIRequestBody,
    origin: RequestOrigin,
    resources: ServerResources,
) -> AnswerPlan:
    """``n`` checked against the slots, the request built (``RequestBuilder.build``), then one
    choice, or a group of ``body.choices`` whose JSON body merges every choice's and whose
    stream ends with one usage chunk over all (when asked).

    Raises:
        APIError: 422 naming ``n`` (``check_choices``); the builder's refusals.
    """
    check_choices(body, resources)
    generation = await resources.builder.build(body.generation_params(), origin)
    if body.choices == 1:
        writer = openai_answer_format(answer_format, body, generation, resources)
        return AnswerPlan([generation], [writer], stream=body.streamed)
    generations = choice_requests(generation, body.choices)
    formats = [
        openai_answer_format(answer_format, body, choice, resources, index=index, group=True)
        for index, choice in enumerate(generations)
    ]
    return AnswerPlan(
        generations,
        formats,
        stream=body.streamed,
        group_body=partial(merged_body, formats),
        trailer=partial(usage_trailer, formats) if body.include_usage else None,
    )


def check_choices(body: OpenAIRequestBody, resources: ServerResources) -> None:
    """``n`` must fit the batch slots (a group is admitted all at once).

    Raises:
        APIError: 422 naming ``n`` (OpenAI's 400 under ``/v1``).
    """
    slots = resources.engine.capabilities.max_num_seqs
    if body.choices > slots:
        raise APIError(
            422, "invalid_request", f"n ({body.choices}) exceeds the {slots} batch slots", param="n"
        )


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
    """The usage of a group: the prompt counted once, the tokens of every choice."""
    prompt = finals[0].prompt_tokens
    completion = sum(final.completion_tokens for final in finals)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def usage_trailer(
    formats: Sequence[ChoiceFormat], finals: Sequence[FinalEvent]
) -> list[ServerSentEvent]:
    """A group's stream ends with one usage chunk over every choice."""
    return [formats[0].usage_event(group_usage(finals))]


def openai_answer_format(
    answer_format: type[ChoiceFormat],
    body: OpenAIRequestBody,
    generation: GenerationRequest,
    resources: ServerResources,
    *,
    index: int = 0,
    group: bool = False,
) -> ChoiceFormat:
    """How the answer to ``body`` (choice ``index``) is written: the request id as the
    object's id (a group's: the group's id), created now,
    the model's name; logprobs and the echoed prompt when asked. In a group (``n`` > 1) the
    usage chunk is the group's, not the choice's. A chat's reasoning is split out when the
    server's parser is on (``resources.reasoning``)."""
    engine = resources.engine
    writer = None
    echo = ""
    if isinstance(body, CompletionRequestBody) and body.echo:
        echo = (
            body.prompt
            if isinstance(body.prompt, str)
            else engine.decode(generation.prompt_token_ids)
        )
    scores_prompt = generation.sampling.prompt_logprobs is not None
    if generation.sampling.logprobs is not None:
        # chat's content lists the tokens of the message; completions list every token, as
        # vLLM's do (a harness slices them by position: the ending token keeps its place)
        hidden: frozenset[int] = frozenset()
        if answer_format is ChatAnswer:
            hidden = frozenset(generation.stop.stop_token_ids)
            if not generation.stop.ignore_eos:
                hidden |= engine.capabilities.eos_token_ids
        offset = 0 if scores_prompt else len(echo)  # else the prompt's tokens count it
        writer = LogprobsWriter(engine.token_bytes, hidden, text_offset=offset)
    fields: dict[str, object] = {}
    if answer_format is CompletionAnswer:
        fields = {"echo": echo, "echo_first_token": generation.prompt_token_ids[0]}
    elif isinstance(body, ChatCompletionRequestBody):
        fields = {"tools": body.tool_plan, "reasoning": resources.reasoning_for(generation)}
    return answer_format(
        id=generation.request_id if not group else generation.group_id or generation.request_id,
        created=int(time.time()),
        model=engine.capabilities.name,
        include_usage=body.include_usage and not group,
        index=index,
        logprobs=writer,
        **fields,  # type: ignore[arg-type]
    )
