"""Puts scripts/ on sys.path so tests import the load generator and the server-process helpers
the way the scripts themselves do; the session's tiny model checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.checkpoints import TinyCheckpoints

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """Tiny random-weight HF directories and GGUF files (``tests/checkpoints.py``), each variant
    built once per session: ``tiny_checkpoints.hf("qwen2")``,
    ``tiny_checkpoints.gguf("llama", "Q4_K", tied=False)``."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-checkpoints"))
