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
