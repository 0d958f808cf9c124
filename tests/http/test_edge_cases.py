"""Edge cases found by a fresh user: a client leaving mid-body, and huge prompts."""

from __future__ import annotations

import logging
import threading

from app.api import request_builder
from app.api.server import create_app
from tests.http.conftest import app_client, mock_config, post_generate_scope


async def test_client_leaving_before_its_body_is_a_quiet_499(caplog) -> None:
    """Found: the ClientDisconnect from read_body was logged as an unhandled 500 with a
    traceback. Now: 499 (nobody reads it), an info line, no error log."""
    app = create_app(mock_config())
    async with app.router.lifespan_context(app):
        messages = [
            {"type": "http.request", "body": b'{"prompt": "Hi"', "more_body": True},
            {"type": "http.disconnect"},
        ]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        with caplog.at_level(logging.INFO):
            await app(post_generate_scope((b"content-length", b"100")), receive, send)
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_long_prompts_are_tokenized_off_the_event_loop(monkeypatch) -> None:
    """Found: a 1 MB prompt was tokenized on the event loop (~1 s), stalling every stream."""
    async with app_client() as client:
        tokenizer = client.model.tokenizer  # type: ignore[attr-defined]
        threads: list[int] = []
        encode = tokenizer.encode

        def recording_encode(text: str) -> list[int]:
            threads.append(threading.get_ident())
            return encode(text)

        monkeypatch.setattr(tokenizer, "encode", recording_encode)
        loop_thread = threading.get_ident()
        short = {"prompt": "hi", "max_tokens": 1}
        long = {"prompt": "x" * (request_builder.INLINE_TOKENIZE_MAX_CHARS + 1), "max_tokens": 1}
        for body in (short, long):
            response = await client.post("/generate", json=body)
            assert response.status_code in (200, 400), response.text
    assert threads[0] == loop_thread
    assert threads[1] != loop_thread


async def test_the_default_max_tokens_follows_the_servers_cap():
    """A request that does not send ``max_tokens`` gets the wire's default lowered to
    ``--max-tokens-cap`` (was a 422 "max_tokens must be <= 100" about a field the client never
    sent; found by a helper); one that sends more than the cap is still refused."""
    async with app_client(mock_config(max_tokens_cap=3)) as client:
        native = await client.post("/generate", json={"prompt": "abc"})
        assert native.status_code == 200, native.text
        assert native.json()["usage"]["completion_tokens"] <= 3
        legacy = await client.post("/v1/completions", json={"prompt": "abc"})
        assert legacy.status_code == 200, legacy.text
        assert legacy.json()["usage"]["completion_tokens"] <= 3
        asked = await client.post("/generate", json={"prompt": "abc", "max_tokens": 4})
        assert asked.status_code == 422
        assert asked.json()["error"]["param"] == "max_tokens"


async def test_a_trailing_slash_is_an_unknown_path_with_its_request_id():
    """``DELETE /generate/`` was a 307 to ``/generate`` without ``X-Request-Id`` (API.md: every
    response carries it; found by a helper): now a 404 like any unknown path."""
    async with app_client() as client:
        for method, path in (("DELETE", "/generate/"), ("POST", "/generate/")):
            response = await client.request(method, path, json={"prompt": "a"})
            assert response.status_code == 404, (method, path)
            assert response.headers["X-Request-Id"]
        response = await client.post("/v1/completions/", json={"prompt": "a"})
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "invalid_request_error"
