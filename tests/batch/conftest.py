"""Batch runner fixtures: input lines built as a client writes them, output lines read back."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.batch.config import BatchConfig


def batch_line(custom_id: str, body: dict[str, Any], url: str = "/v1/completions") -> str:
    """One OpenAI Batch input line (no line end)."""
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat_body(content: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **fields}


def write_input(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def batch_config(tmp_path: Path, **overrides: Any) -> BatchConfig:
    values: dict[str, Any] = {
        "input": str(tmp_path / "in.jsonl"),
        "output": str(tmp_path / "out.jsonl"),
        "model": "mock",
        "max_num_seqs": 4,
        "progress": False,
    }
    values.update(overrides)
    return BatchConfig(**values)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """``command.main`` sets up the root logger as a process of its own would (a rich handler
    beside the bar); put back what the test process had."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
