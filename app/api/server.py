"""The FastAPI app: routes, error handlers, request ids, and the engine's lifetime."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import Histogram
from starlette.types import ASGIApp

from app import __version__
from app.api import generate, status, tokenize, ui
from app.api.admission_gate import AdmissionGate
from app.api.anthropic import errors as anthropic_errors
from app.api.anthropic import routes as anthropic_routes
from app.api.auth import ApiKeyGuard
from app.api.errors import install_error_handlers
from app.api.openai import errors as openai_errors
from app.api.openai import routes as openai_routes
from app.api.request_id import RequestIdMiddleware
from app.api.resources import ServerResources
from app.api.sse_response import StackSend
from app.config import ServerConfig
from app.engine.chat_template import template_override
from app.engine.engine import AdmissionLimits, AsyncEngine
from app.engine.metrics import EVENT_LOOP_LAG_INTERVAL_S
from app.engine.model_thread import ModelThread
from app.engine.policy import make_policy
from app.engine.speculation import NgramSpeculation
from app.models.base import Model
from app.models.loading import load_model

if TYPE_CHECKING:  # the real model's modules load only for a real model
    from app.models.load.plan import LoadPlan

logger = logging.getLogger(__name__)


class SlotserveAPI(FastAPI):
    """FastAPI with :class:`StackSend` around its middleware stack: streamed answers' body
    chunks go to the ``send`` the stack was given (``app/api/sse_response.py``)."""

    def build_middleware_stack(self) -> ASGIApp:
        return StackSend(super().build_middleware_stack())


async def drain_app(app: FastAPI, timeout_s: float) -> None:
    """Graceful drain: refuse new requests (503, /health 503), let in-flight ones finish for up
    to ``timeout_s`` seconds, then end the rest as cancelled (each gets its final event)."""
    resources: ServerResources | None = getattr(app.state, "resources", None)
    if resources is None:
        return
    logger.info(
        "draining: %d requests in flight, up to %.1f s", resources.engine.num_in_flight, timeout_s
    )
    await resources.engine.drain(timeout_s)
    await resources.engine.stop()
    logger.info("drained")


async def watch_event_loop_lag(
    histogram: Histogram, interval_s: float = EVENT_LOOP_LAG_INTERVAL_S
) -> None:
    """Forever: sleep ``interval_s`` seconds and record how much later than asked the loop woke
    us (seconds) in ``histogram``. Everything on the loop (routes, SSE sends, the scheduler's
    bookkeeping between steps) delays every client by that much; the model step runs off the
    loop and should not show here. Costs one timer wake-up per interval."""
    clock = asyncio.get_running_loop().time
    while True:
        asked = clock() + interval_s
        await asyncio.sleep(interval_s)
        histogram.observe(max(0.0, clock() - asked))


def create_app(
    config: ServerConfig, *, model: Model | None = None, model_plan: LoadPlan | None = None
) -> FastAPI:
    """Builds the app. The model is loaded (or ``model`` used) when the app starts.

    Args:
        config: server settings.
        model: an already-built model (tests); None loads the one ``config`` names.
        model_plan: that model, already opened and checked (``app.models.loading.
            inspect_model``, which the command line runs before the port opens); None: it is
            checked when the app starts.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Loaded on the thread that will step it: one OpenMP team (app.engine.model_thread).
        model_thread = ModelThread()
        try:
            if model is not None:
                loaded = model
            elif model_plan is not None:  # checked on the command line already
                loaded = await model_thread.run(load_model, config, model_plan)
            else:
                loaded = await model_thread.run(load_model, config)
        except BaseException:
            model_thread.shutdown()
            raise
        engine = AsyncEngine(
            loaded,
            policy=make_policy(config.scheduling),
            max_num_batched_tokens=config.max_num_batched_tokens,
            limits=AdmissionLimits(
                max_queue=config.max_queue, max_queued_tokens=config.max_queued_tokens
            ),
            prefix_caching=config.prefix_caching,
            speculation=NgramSpeculation(config.speculative_ngram),
            model_thread=model_thread,
            chat_template=template_override(config.chat_template),
        )
        await engine.start()
        app.state.resources = ServerResources.build(engine, config)
        logger.info(
            "serving %s with %d slots; API key %s",
            engine.capabilities.name,
            engine.capabilities.max_num_seqs,
            "required" if app.state.resources.guard.enabled else "not required",
        )
        lag_watch = asyncio.create_task(
            watch_event_loop_lag(engine.metrics.event_loop_lag), name="event-loop-lag"
        )
        try:
            yield
        finally:
            await engine.drain(config.shutdown_timeout)
            await engine.stop()
            lag_watch.cancel()

    # With API keys on, the schema and docs pages are off too: every endpoint but /health
    # needs the key, and these pages cannot check one.
    keyed = bool(ApiKeyGuard.from_setting(config.api_key).enabled)
    app = SlotserveAPI(
        title="slotserve",
        version=__version__,
        summary="Text generation with continuous batching",
        lifespan=lifespan,
        openapi_url=None if keyed else "/openapi.json",
        docs_url=None if keyed else "/docs",
        redoc_url=None if keyed else "/redoc",
        redirect_slashes=False,  # "/generate/" is a 404 as any unknown path, not a 307
    )
    # the last added runs first: the request id, then the gate (its answers carry the id)
    app.add_middleware(AdmissionGate, state=app.state)
    app.add_middleware(RequestIdMiddleware, replica_id=config.replica_id)
    install_error_handlers(app)
    openai_errors.install_error_handlers(app)  # under /v1: OpenAI's error shape
    anthropic_errors.install_error_handlers(app)  # under /v1/messages: Anthropic's
    app.include_router(generate.router)
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(status.router)
    app.include_router(tokenize.router)
    if config.ui:
        app.include_router(ui.router)
    return app
