"""Sampling controls, logprobs and n through the HTTP API on a real (tiny, random-weight)
float32 model, against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from harness.sse import parse_events

from app.models.load.plan import load_checkpoint
from tests.checkpoints import load_transformers_model, transformers_logits
from tests.http.any_model import transformers_greedy
from tests.http.conftest import app_client, mock_config, parse_sse

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

PROMPT = "The capital of France is"
SLOTS = 6


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    path = tiny_checkpoints.hf("llama")
    runner = load_checkpoint(path, max_num_seqs=SLOTS, max_model_len=128, dtype="float32")
    return path, runner


async def test_greedy_with_repetition_penalty_equals_transformers_generate(llama) -> None:
    path, runner = llama
    prompt_ids = runner.tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    async with app_client(mock_config(max_num_seqs=SLOTS), model=runner) as client:
        plain = (await client.post("/generate", json=body)).json()
        penalised = (
            await client.post("/generate", json={**body, "repetition_penalty": 1.3})
        ).json()
    want = transformers_greedy(path, prompt_ids, 16, repetition_penalty=1.3)
    assert penalised["token_ids"] == want
    assert plain["token_ids"] == transformers_greedy(path, prompt_ids, 16)
    assert plain["token_ids"] != penalised["token_ids"]  # the penalty changed something


async def test_logprobs_equal_transformers_log_softmax(llama) -> None:
    path, runner = llama
    prompt_ids = runner.tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 5}
    # the processors change the draw, never the reported (raw) logprobs
    body |= {"ignore_eos": True, "repetition_penalty": 1.5, "logit_bias": {"100": 5.0}}
    async with app_client(mock_config(max_num_seqs=SLOTS), model=runner) as client:
        answer = (await client.post("/generate", json=body)).json()
        streamed = await client.post("/generate", json={**body, "stream": True})
    generated = answer["token_ids"]
    reference = transformers_logits(load_transformers_model(path), prompt_ids + generated)
    logprobs = reference.log_softmax(-1)[len(prompt_ids) - 1 : -1]
    assert len(answer["logprobs"]) == len(generated)
    for position, entry in enumerate(answer["logprobs"]):
        assert entry["token_id"] == generated[position]
        want = logprobs[position, generated[position]].item()
        assert abs(entry["logprob"] - want) <= 1e-3
        top_values, top_ids = logprobs[position].topk(5)
        assert [t["token_id"] for t in entry["top"]] == top_ids.tolist()
        got_values = torch.tensor([t["logprob"] for t in entry["top"]])
        assert torch.allclose(got_values, top_values, atol=1e-3)
    events = [data for name, data in parse_sse(streamed.text) if name == "token"]
    assert [e for event in events for e in event["logprobs"]] == answer["logprobs"]
    assert [t for event in events for t in event["token_ids"]] == generated


async def test_n_with_a_seed_gives_choices_equal_to_single_requests(llama) -> None:
    _, runner = llama
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 40}
    async with app_client(mock_config(max_num_seqs=SLOTS), model=runner) as client:
        group = await client.post("/v1/completions", json={**body, "n": 4, "best_of": 4})
        singles = [
            (await client.post("/v1/completions", json={**body, "seed": 40 + i})).json()
            for i in range(4)
        ]
        streamed = await client.post(
            "/v1/completions",
            json={**body, "n": 4, "stream": True, "stream_options": {"include_usage": True}},
        )
    assert group.status_code == 200, group.text
    answer = group.json()
    texts = [choice["text"] for choice in answer["choices"]]
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2, 3]
    assert texts == [single["choices"][0]["text"] for single in singles]
    assert len(set(texts)) == 4
    completion_tokens = sum(s["usage"]["completion_tokens"] for s in singles)
    assert answer["usage"]["completion_tokens"] == completion_tokens
    assert answer["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    chunks = [e.json() for e in parse_events(streamed.text) if e.data != "[DONE]"]
    joined = ["", "", "", ""]
    for chunk in chunks:
        for choice in chunk["choices"]:
            joined[choice["index"]] += choice["text"]
    assert joined == texts
    assert chunks[-1]["usage"]["completion_tokens"] == completion_tokens
    assert streamed.text.rstrip().endswith("data: [DONE]")


async def test_openai_logprobs_shapes(llama) -> None:
    _, runner = llama
    async with app_client(mock_config(max_num_seqs=SLOTS), model=runner) as client:
        completion = (
            await client.post(
                "/v1/completions",
                json={
                    "prompt": PROMPT,
                    "max_tokens": 5,
                    "temperature": 0,
                    "logprobs": 3,
                    "ignore_eos": True,
                },
            )
        ).json()
        chat = (
            await client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                    "temperature": 0,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "ignore_eos": True,
                },
            )
        ).json()
    choice = completion["choices"][0]
    legacy = choice["logprobs"]
    assert "".join(legacy["tokens"]) == choice["text"]
    assert len(legacy["token_logprobs"]) == len(legacy["tokens"]) == len(legacy["text_offset"])
    assert legacy["text_offset"][0] == 0
    for token, logprob, top in zip(
        legacy["tokens"], legacy["token_logprobs"], legacy["top_logprobs"], strict=True
    ):
        assert logprob <= 0 and len(top) <= 3
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the best alternative
        assert top[token] == pytest.approx(logprob)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    for entry in content:
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
