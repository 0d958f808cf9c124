"""``--kv-cache-memory`` and ``--prefix-caching`` / ``--no-prefix-caching``: parsing, refusals,
and what the mock's pool becomes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import ServerConfig, parse_memory_size
from app.models.loading import inspect_model, load_model
from app.models.refusal import ModelRefused


@pytest.mark.parametrize(
    ("text", "value"),
    [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("400MB", 400 * 10**6), ("0.3", 0.3)],
)
def test_sizes_and_fractions(text: str, value: float) -> None:
    assert parse_memory_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "1.5", "0", "0MiB", "12 parsecs", "-1GiB"])
def test_bad_sizes_are_refused_at_start_up(text: str) -> None:
    with pytest.raises(ValidationError, match="kv_cache_memory"):
        ServerConfig(kv_cache_memory=text)


def test_prefix_caching_is_on_by_default_and_a_flag_turns_it_off() -> None:
    assert ServerConfig().prefix_caching is True
    assert ServerConfig(_cli_parse_args=["--no-prefix-caching"]).prefix_caching is False
    flags = ServerConfig(_cli_parse_args=["--kv-cache-memory", "64MiB"])
    assert flags.kv_cache_memory == "64MiB"


def test_the_mock_pool_follows_the_flag() -> None:
    default = load_model(ServerConfig(model="mock", mock_context_length=1024))
    assert default.capabilities.num_kv_blocks == 1 + 16 * 1024 // 16
    sized = load_model(ServerConfig(model="mock", mock_context_length=1024, kv_cache_memory="1MiB"))
    assert sized.capabilities.num_kv_blocks == 1 + 2**20 // (4 * 16)
    tiny = ServerConfig(model="mock", mock_context_length=1024, kv_cache_memory="1KiB")
    with pytest.raises(ValueError, match="fewer than one sequence"):
        load_model(tiny)
    with pytest.raises(ModelRefused, match="fewer than one sequence"):
        inspect_model(tiny)  # on the command line, before the port opens


@pytest.mark.parametrize(
    "field", ["mock_step_ms", "sse_ping_interval", "sse_send_timeout", "shutdown_timeout"]
)
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_seconds_and_milliseconds_are_finite(field: str, value: float) -> None:
    """(found by a helper) ``--mock-step-ms inf`` started a server whose every request was a
    500 (the step's end time overflowed)."""
    with pytest.raises(ValidationError, match=field):
        ServerConfig(**{field: value})


@pytest.mark.parametrize("device", ["meta", "tpu", "cpu:abc", "", "cuda:x"])
def test_a_device_outside_auto_cpu_cuda_is_refused(device: str) -> None:
    with pytest.raises(ValidationError, match="device"):
        ServerConfig(device=device)
    assert ServerConfig(device="cuda:1").device == "cuda:1"
