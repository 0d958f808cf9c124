"""Prompt logprobs (the echoed prompt's scores: how evaluation harnesses score a text) on a real
tiny float32 model: equal to transformers' log_softmax, computed chunk by chunk during prefill
without a ``[prompt_len, vocab]`` tensor, and with ``max_tokens: 0`` the prefill still runs."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from app.models.load.plan import load_checkpoint
from tests.checkpoints import load_transformers_model, transformers_logits
from tests.http.conftest import app_client, mock_config

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

SLOTS = 2
VOCAB = 49152  # the tiny checkpoints use SmolLM2's tokenizer


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    path = tiny_checkpoints.hf("llama")
    runner = load_checkpoint(path, max_num_seqs=SLOTS, max_model_len=2048, dtype="float32")
    return path, runner


def _reference(path: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-probability of each token after the first."""
    logprobs = transformers_logits(load_transformers_model(path), token_ids).log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


async def test_echo_logprobs_with_max_tokens_0_score_the_prompt(llama) -> None:
    path, runner = llama
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    async with app_client(mock_config(max_num_seqs=SLOTS), model=runner) as client:
        answer = (await client.post("/v1/completions", json=body)).json()
        with_tokens = (await client.post("/v1/completions", json={**body, "max_tokens": 3})).json()
    prompt_ids = runner.tokenizer.encode(prompt)
    choice = answer["choices"][0]
    legacy = choice["logprobs"]
    assert choice["text"] == prompt
    assert choice["finish_reason"] == "length"
    assert answer["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 0,
        "total_tokens": len(prompt_ids),
    }
    assert len(legacy["tokens"]) == len(prompt_ids)
    assert legacy["token_logprobs"][0] is None and legacy["top_logprobs"][0] is None
    assert "".join(legacy["tokens"]) == prompt
    want = _reference(path, prompt_ids)
    got = torch.tensor(legacy["token_logprobs"][1:])
    assert torch.allclose(got, want, atol=1e-3)
    assert legacy["text_offset"][0] == 0 and legacy["text_offset"] == sorted(legacy["text_offset"])
    # each scored token is among its alternatives, as OpenAI's and vLLM's legacy answers hold it
    # (up to logprobs + 1 of them, most likely first; found by a helper: a token outside the
    # best 2 was missing)
    for token, logprob, top in zip(
        legacy["tokens"][1:], legacy["token_logprobs"][1:], legacy["top_logprobs"][1:], strict=True
    ):
        assert top[token] == logprob and 2 <= len(top) <= 3
        assert list(top.values()) == sorted(top.values(), reverse=True)
    assert any(len(top) == 3 for top in legacy["top_logprobs"][1:])  # the case that was missing
    # with tokens after the prompt: the prompt's entries first, then the completion's
    more = with_tokens["choices"][0]["logprobs"]
    assert more["token_logprobs"][: len(prompt_ids)] == legacy["token_logprobs"]
    assert len(more["tokens"]) == len(prompt_ids) + with_tokens["usage"]["completion_tokens"]


async def test_long_prompt_logprobs_are_exact_and_never_hold_the_whole_matrix(llama) -> None:
    path, runner = llama
    generator = torch.Generator().manual_seed(5)
    prompt_ids = torch.randint(3, VOCAB, (1500,), generator=generator).tolist()
    prompt = runner.tokenizer.decode_bytes(prompt_ids).decode("utf-8", errors="ignore")
    prompt_ids = runner.tokenizer.encode(prompt)[:1500]
    prompt = runner.tokenizer.decode_bytes(prompt_ids).decode("utf-8", errors="ignore")
    prompt_ids = runner.tokenizer.encode(prompt)
    assert len(prompt_ids) > 1024  # three prefill chunks of 512
    body = {"prompt": prompt, "max_tokens": 0, "prompt_logprobs": 1}
    async with app_client(mock_config(max_num_seqs=SLOTS), model=runner) as client:
        await client.post("/generate", json={**body, "prompt": "warm up"})
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = _kib("VmRSS")
        answer = (await client.post("/generate", json=body)).json()
        peak = _kib("VmHWM")
    entries = answer["prompt_logprobs"]
    assert answer["token_ids"] == [] and answer["finish_reason"] == "length"
    assert len(entries) == len(prompt_ids) and entries[0] is None
    assert [e["token_id"] for e in entries[1:]] == prompt_ids[1:]
    got = torch.tensor([e["logprob"] for e in entries[1:]])
    assert torch.allclose(got, _reference(path, prompt_ids), atol=1e-3)
    # [1500, 49152] float32 logits would be 295 MB; 64 positions at a time are 12.6 MB
    assert (peak - before) * 1024 < 120e6, f"RSS rose {(peak - before) / 1024:.0f} MiB"
