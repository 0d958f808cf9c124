"""The session's tiny model checkpoints (``tests/checkpoints.py``) and its forked command line
(``tests/forked_cli.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.checkpoints import TinyCheckpoints
from tests.forked_cli import ForkedCli


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """Tiny random-weight HF directories and GGUF files (``tests/checkpoints.py``), each variant
    built once per session: ``tiny_checkpoints.hf("qwen2")``,
    ``tiny_checkpoints.gguf("llama", "Q4_K", tied=False)``."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-checkpoints"))


@pytest.fixture(scope="session")
def forked_cli() -> Iterator[ForkedCli]:
    """``forked_cli.run("-m", "app", "serve", ...)``: the command line as a fresh process whose
    imports were paid once per session (``tests/forked_cli.py``)."""
    driver = ForkedCli()
    try:
        yield driver
    finally:
        driver.close()
