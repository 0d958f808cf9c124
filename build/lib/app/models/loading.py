"""Builds the model a config asks for (the only place that knows every implementation)."""

from __future__ import annotations

import logging
import time

from app.config import ServerConfig
from app.models.base import Model
from app.models.mock import MockModelRunner

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    """``auto`` becomes ``cuda`` when torch sees a GPU, else ``cpu``."""
    if device != "auto":
        return device
    import torch  # local: the mock server must not need torch loaded

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(config: ServerConfig) -> Model:
    """Loads the configured model; may take seconds for the real one. Raises on failure."""
    started = time.perf_counter()
    model: Model
    if config.model == "mock":
        model = MockModelRunner(
            max_num_seqs=config.max_num_seqs,
            context_length=config.mock_context_length,
            step_ms=config.mock_step_ms,
            fail_every=config.mock_fail_every,
        )
    else:
        import torch  # local: the mock server must not need torch loaded

        from app.models.smollm2 import load_smollm2

        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        model = load_smollm2(
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            dtype=config.dtype,
            device=resolve_device(config.device),
            quantization=config.quantization,
        )
    logger.info(
        "loaded %s (%s) in %.2f s",
        model.capabilities.name,
        model.capabilities.backend,
        time.perf_counter() - started,
    )
    return model
