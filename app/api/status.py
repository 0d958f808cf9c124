"""``GET /health``, ``GET /info``, ``GET /metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from app import __version__
from app.api.errors import error_body
from app.api.resources import resources_of
from app.api.schemas import SAMPLING_FIELDS, ErrorResponse, HealthResponse, InfoResponse

router = APIRouter()


@router.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    """200 while the model is loaded and the scheduler loop runs; 503 otherwise. No key needed."""
    resources = getattr(request.app.state, "resources", None)
    if resources is None or not resources.engine.is_alive:
        state = "loading" if resources is None else resources.engine.state.value
        return JSONResponse(
            error_body("unavailable", f"the server is not serving ({state})"), status_code=503
        )
    return JSONResponse({"status": "ok"})


# HEAD /health for probes that send HEAD (some load balancers); the same answer without a body.
# Kept out of the schema: one operation per path and method there.
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)


@router.get("/info", response_model=InfoResponse, responses={503: {"model": ErrorResponse}})
async def info(request: Request) -> InfoResponse:
    """The loaded model and the server's limits."""
    resources = resources_of(request)
    resources.guard.owner_of(request)
    caps = resources.engine.capabilities
    return InfoResponse(
        model=caps.name,
        backend=caps.backend,
        context_length=caps.context_length,
        max_num_seqs=caps.max_num_seqs,
        max_tokens_cap=resources.builder.limits.max_tokens_cap,
        vocab_size=caps.vocab_size,
        keeps_kv_cache=caps.keeps_kv_cache,
        scheduling=resources.engine.policy_name,
        version=__version__,
        sampling_fields=list(SAMPLING_FIELDS),
        kv_block_size=caps.kv_block_size,
        num_kv_blocks=max(0, caps.num_kv_blocks - 1),
        prefix_caching=resources.engine.prefix_caching,
        speculative_ngram=resources.engine.speculative_ngram,
        spec_decode_acceptance_rate=resources.engine.metrics.spec_decode_acceptance_rate,
        weight_kernels=caps.weight_kernels,
    )


@router.get("/metrics", response_class=Response, responses={503: {"model": ErrorResponse}})
async def metrics(request: Request) -> Response:
    """Prometheus text format: the ``slotserve_*`` names, then the same values under vLLM's
    names with a ``model_name`` label (API.md "Metrics under vLLM's names")."""
    resources = resources_of(request)
    resources.guard.owner_of(request)
    text = resources.engine.metrics.render(model_name=resources.engine.capabilities.name)
    return Response(text, media_type=CONTENT_TYPE_LATEST)
