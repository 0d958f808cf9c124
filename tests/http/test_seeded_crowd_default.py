"""A seeded sampled request gets the same tokens alone and in a crowd of unseeded sampled
requests, on ``python -m app serve``'s default configuration (issue 15's bug: the default
dtype is bfloat16 and the crowd's decode steps went through the fused kernels)."""

from __future__ import annotations

import asyncio

import pytest

from app.config import ServerConfig
from app.models.load.plan import LoadOptions, load_runner, plan_load
from tests.http.conftest import app_client, wait_for_queue

pytestmark = pytest.mark.slow

SLOTS = 6
MODES = {
    "temperature": {},
    "top_p": {"top_p": 0.95},
    "top_k": {"top_k": 50},
    "min_p": {"min_p": 0.05},
    "penalties": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.2,
        "logit_bias": {"11": 2.0},
        "min_tokens": 4,
    },
}


def _default_config(**overrides) -> ServerConfig:
    """The serve command's defaults (model, dtype, quantization, fused decode), fewer slots."""
    return ServerConfig(max_num_seqs=SLOTS, max_model_len=256, **overrides)


@pytest.fixture(scope="module")
def runners():
    """Loads, once per module, the serve defaults ("default": bfloat16, quantization auto,
    fused decode) or the same with dense bfloat16 weights; freed after the module."""
    loaded: dict[str, tuple] = {}

    def load(configuration: str) -> tuple:
        if configuration not in loaded:
            overrides = {} if configuration == "default" else {"quantization": "none"}
            config = _default_config(**overrides)
            runner = load_runner(plan_load(config.model, LoadOptions.from_config(config)))
            loaded[configuration] = (config, runner)
        return loaded[configuration]

    yield load
    loaded.clear()


CASES = [("default", mode) for mode in MODES] + [
    ("bfloat16-dense", "top_p"),
    ("bfloat16-dense", "penalties"),
]


@pytest.mark.parametrize(("configuration", "mode"), CASES)
async def test_seeded_request_alone_equals_in_a_crowd(runners, configuration, mode) -> None:
    config, runner = runners(configuration)
    seeded = {
        "prompt": "My favourite colour is",
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 99,
        "ignore_eos": True,
        **MODES[mode],
    }
    async with app_client(config, model=runner) as client:
        alone = (await client.post("/generate", json=seeded)).json()
        crowd = [
            asyncio.create_task(
                client.post(
                    "/generate",
                    json={
                        "prompt": f"Write a story about the number {i}",
                        "max_tokens": 48,
                        "temperature": 1.0,
                        "ignore_eos": True,
                    },
                )
            )
            for i in range(SLOTS - 1)
        ]
        await wait_for_queue(client, running=len(crowd), timeout=60)
        in_crowd = (await client.post("/generate", json=seeded)).json()
        await asyncio.gather(*crowd)
    assert alone["token_ids"] == in_crowd["token_ids"]
