"""Builds the model a config asks for (the only place that knows every implementation).

The real model is planned and checked first (:func:`inspect_model`, on the command line before
the port opens: every refusal is one line there) and loaded later on the model thread
(:func:`load_model`); :mod:`app.models.load.plan` does both. The mock needs neither torch nor
a plan, so the real model's modules are imported only for a real model.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from app.config import ServerConfig, parse_memory_size
from app.models.base import Model
from app.models.mock import MOCK_BYTES_PER_POSITION, MOCK_KV_BLOCK_SIZE, MockModelRunner
from app.models.refusal import ModelRefused

if TYPE_CHECKING:
    from app.models.load.plan import LoadPlan

logger = logging.getLogger(__name__)


def inspect_model(config: ServerConfig) -> LoadPlan | None:
    """Open and check the configured model and decide how to load it; None for the mock.

    Raises:
        ModelRefused: the model cannot be served (:func:`app.models.load.plan.plan_load`), or
            the mock's KV pool would not hold one sequence.
    """
    if config.model == "mock":
        try:
            _mock_kv_blocks(config)
        except ValueError as error:
            raise ModelRefused("mock", str(error)) from None
        return None
    from app.models.load.plan import LoadOptions, plan_load  # the real model's modules

    try:
        options = LoadOptions.from_config(config)
    except ValueError as error:  # a device this torch cannot use
        raise ModelRefused(config.model, str(error)) from None
    return plan_load(config.model, options)


def load_model(config: ServerConfig, plan: LoadPlan | None = None) -> Model:
    """Loads the configured model; may take seconds for the real one. ``plan``: what
    :func:`inspect_model` gave for this config (None: inspected here).

    Raises:
        ModelRefused: the model cannot be served. Anything else: the load failed.
    """
    started = time.perf_counter()
    model: Model
    if config.model == "mock":
        model = MockModelRunner(
            max_num_seqs=config.max_num_seqs,
            context_length=config.mock_context_length,
            step_ms=config.mock_step_ms,
            fail_every=config.mock_fail_every,
            kv_blocks=_mock_kv_blocks(config),
        )
        if config.served_model_name is not None:
            model.capabilities = dataclasses.replace(
                model.capabilities, name=config.served_model_name
            )
    else:
        import torch  # the real model's modules

        from app.models.load.cpu_quota import quota_threads
        from app.models.load.plan import load_runner
        from app.models.weights.block_arena_prefault import release_unclaimed

        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        elif (threads := quota_threads(torch.get_num_threads())) != torch.get_num_threads():
            logger.info(
                "torch threads: %d (the CPUs this process may use: quota, affinity)", threads
            )
            torch.set_num_threads(threads)
        if plan is None:
            plan = inspect_model(config)
            assert plan is not None  # not the mock
        try:
            runner = load_runner(plan)
        finally:
            release_unclaimed()  # memory faulted in for an arena this load did not take
        if config.warmup:
            budget = (
                config.max_num_batched_tokens or runner.capabilities.default_max_num_batched_tokens
            )
            warm = runner.warm_up(budget)
            logger.info(
                "warm-up: %d decode rows of %d positions beside a %d-token chunk in %.1f s",
                warm.decode_rows,
                warm.context,
                warm.chunk_tokens,
                warm.seconds,
            )
        model = runner
    logger.info(
        "loaded %s (%s) in %.2f s",
        model.capabilities.name,
        model.capabilities.backend,
        time.perf_counter() - started,
    )
    return model


def _mock_kv_blocks(config: ServerConfig) -> int:
    """The mock's pool, sized as the real model's is (``app.models.forward.kv_cache.pool_blocks``),
    at
    ``MOCK_BYTES_PER_POSITION`` bytes a position.

    Raises:
        ValueError: the pool would not hold one sequence of the mock's context length.
    """
    import psutil

    setting = None if config.kv_cache_memory is None else parse_memory_size(config.kv_cache_memory)
    per_block = MOCK_BYTES_PER_POSITION * MOCK_KV_BLOCK_SIZE
    one_sequence = -(-config.mock_context_length // MOCK_KV_BLOCK_SIZE)
    if setting is None:
        usable = max(16, config.max_num_seqs) * one_sequence
    else:
        available = psutil.virtual_memory().available
        usable = (int(setting * available) if isinstance(setting, float) else setting) // per_block
    if usable < one_sequence:
        raise ValueError(
            f"--kv-cache-memory gives the mock {usable} KV blocks, fewer than one sequence of "
            f"--mock-context-length {config.mock_context_length} needs ({one_sequence})"
        )
    return usable + 1
