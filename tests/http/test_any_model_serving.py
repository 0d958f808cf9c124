"""Serving the model the user brings, end to end, on tiny random-weight checkpoints
(``tests/checkpoints.py``): greedy tokens through the server equal transformers' greedy
generation for every architecture from its HF directory and its GGUF; ``python -m app serve
--model PATH`` answers JSON and streams, cancels, keeps seeded requests batch-invariant and
renders the model's own chat template."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from harness.sse import EventStream

from app.models.load.plan import load_checkpoint
from app.models.tokenizers import load_hf_tokenizer
from tests.checkpoints import ARCHITECTURES
from tests.http.any_model import serve_cli, transformers_greedy
from tests.http.conftest import app_client, mock_config, parse_sse

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

PROMPT = "The capital of France is"
NEW_TOKENS = 12
GREEDY = {"temperature": 0, "ignore_eos": True}
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.mark.parametrize("file_format", ["hf", "gguf"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
async def test_greedy_tokens_equal_transformers(tiny_checkpoints, architecture, file_format):
    hf = tiny_checkpoints.hf(architecture)
    path = hf if file_format == "hf" else tiny_checkpoints.gguf(architecture, "F32")
    runner = load_checkpoint(path, max_num_seqs=2, max_model_len=64, dtype="float32")
    prompt_ids = runner.tokenizer.encode(PROMPT)
    async with app_client(mock_config(max_num_seqs=2), model=runner) as client:
        body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, **GREEDY}
        answer = (await client.post("/generate", json=body)).json()
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids)
    assert answer["token_ids"] == transformers_greedy(hf, prompt_ids, NEW_TOKENS)


@pytest.fixture(scope="module")
def gguf_server(tiny_checkpoints):
    """A float32 server of a Qwen2 GGUF under a name of our choosing."""
    path = tiny_checkpoints.gguf("qwen2", "F32")
    flags = ("--dtype", "float32", "--quantization", "none", "--max-model-len", "256")
    with serve_cli(path, *flags, "--served-model-name", "tiny-q2", "--max-num-seqs", "4") as s:
        yield s


@pytest.fixture(scope="module")
def hf_server(tiny_checkpoints):
    """A Llama HF directory with the default settings (bfloat16, fused decode kernels)."""
    path = tiny_checkpoints.hf("llama")
    with serve_cli(path, "--max-num-seqs", "12", "--max-model-len", "512") as served:
        yield served


async def test_gguf_server_answers_json_and_streams_as_transformers(
    gguf_server, tiny_checkpoints
) -> None:
    hf = tiny_checkpoints.hf("qwen2")
    prompt_ids = load_hf_tokenizer(hf).encode(PROMPT)
    expected = transformers_greedy(hf, prompt_ids, NEW_TOKENS)
    async with httpx.AsyncClient(base_url=gguf_server.url, timeout=120) as client:
        info = (await client.get("/info")).json()
        assert info["model"] == "tiny-q2" and info["backend"] == "torch-cpu-float32"
        assert info["context_length"] == 256
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny-q2"]
        body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, **GREEDY}
        plain = (await client.post("/generate", json=body)).json()
        assert plain["token_ids"] == expected
        streamed = await client.post("/generate", json={**body, "stream": True})
        events = parse_sse(streamed.text)
        assert "".join(d["text"] for name, d in events if name == "token") == plain["text"]
        assert [t for name, d in events if name == "token" for t in d["token_ids"]] == expected
        assert events[-1][0] == "done" and events[-1][1]["finish_reason"] == "length"
        completion = await client.post(
            "/v1/completions", json={"model": "x", "prompt": PROMPT, "max_tokens": 3}
        )
        assert completion.json()["model"] == "tiny-q2"


@pytest.mark.parametrize("which", ["gguf", "hf"])
async def test_chat_uses_the_models_own_template(which, gguf_server, hf_server, tiny_checkpoints):
    """The GGUF's tokenizer.chat_template and the directory's chat_template.jinja, rendered and
    encoded as transformers' apply_chat_template does (no second BOS)."""
    from transformers import AutoTokenizer

    served, architecture = (gguf_server, "qwen2") if which == "gguf" else (hf_server, "llama")
    hf = tiny_checkpoints.hf(architecture)
    reference = AutoTokenizer.from_pretrained(hf)
    rendered = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = reference.encode(rendered, add_special_tokens=False)  # the template wrote the BOS
    async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["chat_template"] == "model"
        body = {"model": "x", "messages": CHAT, "max_tokens": 6, **GREEDY}
        answer = (await client.post("/v1/chat/completions", json=body)).json()
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert answer["usage"]["completion_tokens"] == 6
    if which == "gguf":  # float32: the very tokens transformers picks
        expected = transformers_greedy(hf, ids, 6)
        text = reference.decode(expected, skip_special_tokens=True)
        assert answer["choices"][0]["message"]["content"] == text


async def test_hf_server_names_the_directory_and_cancels(hf_server) -> None:
    async with httpx.AsyncClient(base_url=hf_server.url, timeout=120) as client:
        info = (await client.get("/info")).json()
        assert info["model"] == hf_server.path.name
        assert info["backend"] == "torch-cpu-bfloat16"
        body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, **GREEDY}
        headers = {"X-Request-Id": "cancel-me"}
        async with client.stream("POST", "/generate", json=body, headers=headers) as response:
            stream = EventStream(response)
            assert (await stream.next_event()).event == "token"
            deleted = await client.delete("/generate/cancel-me")
            assert deleted.status_code == 200
            done = (await stream.final_event()).json()
        assert done["finish_reason"] == "cancelled"
        assert done["usage"]["completion_tokens"] < 400


async def test_seeded_request_alone_equals_in_a_crowd(hf_server) -> None:
    seeded = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "seed": 77}
    seeded |= {"top_p": 0.95, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=hf_server.url, timeout=300) as client:
        alone = (await client.post("/generate", json=seeded)).json()
        crowd = [
            client.post(
                "/generate",
                json={"prompt": f"Topic {i}: " * (1 + i % 4), "max_tokens": 16, "ignore_eos": True},
            )
            for i in range(10)
        ]
        results = await asyncio.gather(*crowd, client.post("/generate", json=seeded))
    assert all(r.status_code == 200 for r in results)
    assert results[-1].json()["token_ids"] == alone["token_ids"]
