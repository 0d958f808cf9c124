"""Shared fixtures for the real-model tests: one float32 runner loaded once per session."""

from __future__ import annotations

import pytest

from app.models.load_plan import load_checkpoint
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
