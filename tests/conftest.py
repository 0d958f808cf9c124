"""The session's tiny model checkpoints (``tests/checkpoints.py``)."""

from __future__ import annotations

import pytest

from tests.checkpoints import TinyCheckpoints


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """Tiny random-weight HF directories and GGUF files (``tests/checkpoints.py``), each variant
    built once per session: ``tiny_checkpoints.hf("qwen2")``,
    ``tiny_checkpoints.gguf("llama", "Q4_K", tied=False)``."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-checkpoints"))
