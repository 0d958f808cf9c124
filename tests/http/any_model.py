"""Serving the tiny test checkpoints: a real ``python -m app serve --model PATH`` process, and
transformers' greedy generation to compare it with."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0  # a loaded 2-core machine: torch's import and the GGUF's vocabulary


@dataclass(frozen=True)
class ServedModel:
    url: str
    path: Path
    process: subprocess.Popen


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serve_cli(path: Path, *flags: str) -> Iterator[ServedModel]:
    """``python -m app serve --model path *flags`` on a free port of 127.0.0.1, until /health
    answers 200; SIGTERM and wait at the end. Fails with the server's output if it exits."""
    port = free_port()
    command = [sys.executable, "-m", "app", "serve", "--model", str(path), "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--log-level", "warning", *flags],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if process.poll() is not None:
                output = process.stdout.read() if process.stdout else ""
                raise AssertionError(f"server exited with {process.returncode}:\n{output}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.1)  # polling /health: the condition we wait for
        yield ServedModel(url=url, path=path, process=process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


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
