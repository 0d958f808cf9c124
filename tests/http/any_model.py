"""Serving the tiny test checkpoints: a real ``python -m app serve --model PATH`` process, and
transformers' greedy generation to compare it with."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.server import Server, ServerSpec, running

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0  # a loaded 2-core machine: torch's import and the GGUF's vocabulary


@dataclass(frozen=True)
class ServedModel:
    url: str
    path: Path
    server: Server


@contextmanager
def serve_cli(path: Path, *flags: str) -> Iterator[ServedModel]:
    """``python -m app serve --model path *flags`` on a free port of 127.0.0.1 (the harness's
    server: healthy inside the block, SIGTERM at the end). Raises the harness's ServerFailed,
    with the server's log, if it exits or is not healthy in time."""
    spec = ServerSpec.app(
        f"any-model-{path.name}", "--model", str(path), *flags, ready_timeout_s=START_TIMEOUT_S
    )
    with tempfile.TemporaryDirectory(prefix="slotserve-any-model-") as logs:
        with running(spec, Path(logs)) as server:
            yield ServedModel(url=server.url, path=path, server=server)


def transformers_greedy(
    hf_directory: Path, prompt_ids: list[int], max_new_tokens: int, **generate_options: object
) -> list[int]:
    """transformers' float32 greedy continuation of ``prompt_ids``, never stopping at EOS (as a
    request with ``ignore_eos``); ``generate_options`` go to ``generate`` (a
    ``repetition_penalty``...)."""
    import torch

    from tests.checkpoints import load_transformers_model

    model = load_transformers_model(hf_directory)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=0,
            **generate_options,
        )
    return output[0, len(prompt_ids) :].tolist()
