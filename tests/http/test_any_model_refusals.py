"""Every model the server cannot serve is refused by the real command line before the port
opens: exit status 2, one line naming the path and the reason, no traceback. (More reasons,
checked in-process: tests/models/test_loading.py.)"""

from __future__ import annotations

import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
from harness.server import free_port

from tests.checkpoints import write_gguf

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    path: Path
    reason: str  # a regular expression the error line must contain after the path
    flags: tuple[str, ...] = ()


def _retyped_gguf(source: Path, target: Path, tensor: str, new_type: gguf.GGMLQuantizationType):
    """A copy of ``source`` whose tensor ``tensor`` claims ``new_type`` in its header (a type of
    the same block size and bytes, so the file still parses)."""
    data = bytearray(source.read_bytes())
    name = tensor.encode()
    at = data.find(struct.pack("<Q", len(name)) + name)
    assert at > 0
    dims_at = at + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, dims_at)
    type_at = dims_at + 4 + 8 * n_dims
    struct.pack_into("<I", data, type_at, int(new_type))
    target.write_bytes(bytes(data))
    return target


@pytest.fixture(scope="module")
def cases(tiny_checkpoints, tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("refused")
    hf = tiny_checkpoints.hf("llama")
    text_file = root / "notes.gguf"
    text_file.write_text("not a model\n")
    empty_dir = root / "empty"
    empty_dir.mkdir()
    grok = write_gguf(hf, root / "grok.gguf", architecture="grok")
    q4_0 = tiny_checkpoints.gguf("llama", "Q4_0")
    iq4 = _retyped_gguf(
        q4_0, root / "iq4.gguf", "blk.0.attn_q.weight", gguf.GGMLQuantizationType.IQ4_NL
    )
    assert (
        gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
        == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_0]
    )
    # damaged files a user does get (a download cut short, a bad copy): found by a new user,
    # these went past the check and failed as tracebacks once the server was starting
    weights = hf / "model.safetensors"
    cut_dir = shutil.copytree(hf, root / "cut-safetensors")
    (cut_dir / "model.safetensors").write_bytes(weights.read_bytes()[:100_000])
    scrawled_dir = shutil.copytree(hf, root / "bad-header")
    scrawled = bytearray(weights.read_bytes())
    scrawled[10:20] = b"#" * 10
    (scrawled_dir / "model.safetensors").write_bytes(bytes(scrawled))
    cut_gguf = root / "cut.gguf"
    cut_gguf.write_bytes(q4_0.read_bytes()[:300_000])
    supported = r"\(supported: llama, mistral, qwen2, qwen3, gemma3, phi3, qwen3moe, mixtral\)"
    huge = tiny_checkpoints.hf("llama", max_position_embeddings=10**8)
    return {
        "missing": Case(root / "nowhere.gguf", "no such file or directory"),
        "not-a-gguf": Case(text_file, "not a GGUF file"),
        "no-config": Case(empty_dir, "no config.json"),
        "gguf-architecture": Case(grok, f"unsupported architecture 'grok' {supported}"),
        "tensor-type": Case(iq4, "tensor blk.0.attn_q.weight has unsupported type IQ4_NL"),
        "truncated-safetensors": Case(cut_dir, r"model\.safetensors is truncated"),
        "bad-safetensors-header": Case(scrawled_dir, "model.safetensors is not a safetensors"),
        "truncated-gguf": Case(cut_gguf, r"a truncated or damaged GGUF file \(300000 bytes"),
        "memory": Case(
            huge,
            r"model \d+ MiB \+ KV cache \d+ MiB \(1024 slots x 100000000 positions\) = \d+ MiB, "
            r"more than the \d+ MiB of RAM available",
            ("--max-num-seqs", "1024", "--max-model-len", "100000000"),
        ),
    }


@pytest.fixture(scope="module")
def refused(cases: dict[str, Case], forked_cli) -> dict[str, subprocess.CompletedProcess]:
    """Every case through ``python -m app serve``, each a process of its own forked from one
    that imported the app once (``tests/forked_cli.py``)."""

    def run(case: Case) -> subprocess.CompletedProcess:
        return forked_cli.run(
            "-m",
            "app",
            "serve",
            "--model",
            str(case.path),
            "--port",
            str(free_port()),
            *case.flags,
            timeout=600,
        )

    return {name: run(case) for name, case in cases.items()}


@pytest.mark.parametrize(
    "name",
    [
        "missing",
        "not-a-gguf",
        "no-config",
        "gguf-architecture",
        "tensor-type",
        "truncated-safetensors",
        "bad-safetensors-header",
        "truncated-gguf",
        "memory",
    ],
)
def test_refused_before_the_port_opens(name: str, cases, refused) -> None:
    import re

    case, result = cases[name], refused[name]
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    assert "Uvicorn running" not in output and "Started server process" not in output
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, output
    prefix = f"python -m app serve: error: {case.path}: "
    assert errors[0].startswith(prefix), errors[0]
    assert re.search(case.reason, errors[0][len(prefix) :]), errors[0]


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        ("meta", "--device: expected auto, cpu, cuda or cuda:N, got 'meta'"),
        ("tpu", "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
        ("cuda", "smollm2: --device cuda: this torch (is built without CUDA|sees no GPU)"),
    ],
)
def test_a_device_this_torch_cannot_use_is_one_line(device: str, reason: str, forked_cli) -> None:
    """(found by a helper) ``--device cuda`` without CUDA was a 39-line traceback, and
    ``--device meta`` a server that answered every request with a 500."""
    import re

    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this torch sees a GPU: --device cuda serves")
    result = forked_cli.run(
        "-m", "app", "serve", "--device", device, "--port", str(free_port()), timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert re.search(reason, result.stderr), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
