"""What the routes need, built once per app: the engine, the config, the key guard and the
request builder."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from starlette.datastructures import State

from app.api.auth import ApiKeyGuard
from app.api.errors import APIError
from app.api.reasoning import ReasoningParser, ReasoningSplitter
from app.api.request_builder import RequestBuilder, RequestLimits
from app.config import ServerConfig
from app.engine.engine import AsyncEngine
from app.engine.request import GenerationRequest


@dataclass(frozen=True, slots=True)
class ServerResources:
    """Attributes:
    engine: the running engine.
    config: the server's settings.
    guard: API key checks.
    builder: turns what a client asked for into the engine's requests (with the limits).
    reasoning: whether answers split ``<think>`` blocks out as reasoning (``--reasoning-parser``
        and the chat template in use).
    """

    engine: AsyncEngine
    config: ServerConfig
    guard: ApiKeyGuard
    builder: RequestBuilder
    reasoning: ReasoningParser

    @classmethod
    def build(cls, engine: AsyncEngine, config: ServerConfig) -> ServerResources:
        """The resources of a started engine (also for callers without HTTP, e.g. a batch)."""
        limits = RequestLimits.of(config, engine.capabilities)
        return cls(
            engine=engine,
            config=config,
            guard=ApiKeyGuard.from_setting(config.api_key),
            builder=RequestBuilder(engine, limits),
            reasoning=ReasoningParser.of(config.reasoning_parser, engine.chat_template.source),
        )

    def reasoning_for(self, generation: GenerationRequest) -> ReasoningSplitter | None:
        """The reasoning splitter of one request's output (None: its output is all content),
        told by the end of its prompt."""
        return self.reasoning.for_prompt(
            generation.prompt_token_ids,
            self.engine.decode,
            constrained=generation.constraint is not None,
        )


def loaded_resources(state: State) -> ServerResources | None:
    """The app's resources (``app.state``), or None while the model is still loading."""
    return getattr(state, "resources", None)


def resources_of(request: Request) -> ServerResources:
    """Raises APIError 503 while the model is still loading or after shutdown began."""
    resources = loaded_resources(request.app.state)
    if resources is None:
        raise APIError(503, "unavailable", "the model is loading")
    return resources
