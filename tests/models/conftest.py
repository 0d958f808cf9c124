"""Shared fixtures for the real-model tests: SmolLM2 loaded once per session as float32,
bfloat16 and int8 runners (each load is seconds of GGUF parsing and dequantizing)."""

from __future__ import annotations

import pytest

from app.models.load.plan import load_checkpoint
from app.models.runner import ModelRunner

MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def runner() -> ModelRunner:
    """SmolLM2 in float32 on the CPU. Tests share it: each releases the slots it used."""
    return load_checkpoint("smollm2", max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def tokenizer(runner: ModelRunner):
    return runner.tokenizer


@pytest.fixture(scope="session")
def bf16_runner() -> ModelRunner:
    """SmolLM2 in bfloat16 (fused decode kernels where they build). Tests share it: each
    releases the slots it used and puts back any attribute of its model it swaps."""
    return load_checkpoint(
        "smollm2", max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, dtype="bfloat16"
    )


@pytest.fixture(scope="session")
def int8_runner() -> ModelRunner:
    """SmolLM2 with int8 projections over bfloat16; shared as ``bf16_runner`` is."""
    return load_checkpoint(
        "smollm2",
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        dtype="bfloat16",
        quantization="int8",
    )
