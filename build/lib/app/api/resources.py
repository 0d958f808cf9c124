"""What the routes need, built once per app: the engine, the config and the key guard."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from starlette.datastructures import State

from app.api.auth import ApiKeyGuard
from app.api.errors import APIError
from app.config import ServerConfig
from app.engine.engine import AsyncEngine


@dataclass(frozen=True, slots=True)
class ServerResources:
    """Attributes:
    engine: the running engine.
    config: the server's settings.
    guard: API key checks.
    max_tokens_cap: largest ``max_tokens`` accepted (tokens).
    max_prompt_tokens: largest prompt accepted (tokens).
    """

    engine: AsyncEngine
    config: ServerConfig
    guard: ApiKeyGuard
    max_tokens_cap: int
    max_prompt_tokens: int


def loaded_resources(state: State) -> ServerResources | None:
    """The app's resources (``app.state``), or None while the model is still loading."""
    return getattr(state, "resources", None)


def resources_of(request: Request) -> ServerResources:
    """Raises APIError 503 while the model is still loading or after shutdown began."""
    resources = loaded_resources(request.app.state)
    if resources is None:
        raise APIError(503, "unavailable", "the model is loading")
    return resources
