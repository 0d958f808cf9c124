"""Structured output on the real model through a live server: the schema corpus (every answer
that finished parses and validates with ``jsonschema``), regex and choice, a refused keyword,
and a seeded constrained request alone and in a crowd."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from scenarios.schema_corpus import SCHEMA_CORPUS

from tests.http.conftest import wait_for_queue

pytestmark = pytest.mark.slow

MAX_TOKENS = 96


def _chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


async def test_the_schema_corpus_validates(smollm2_server):
    assert len(SCHEMA_CORPUS) >= 30
    async with httpx.AsyncClient(base_url=smollm2_server.url, timeout=300) as client:

        async def ask(case):
            response = await client.post(
                "/v1/chat/completions",
                json={
                    "messages": _chat(case.prompt),
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": case.name, "schema": case.schema, "strict": True},
                    },
                },
            )
            assert response.status_code == 200, (case.name, response.text)
            return case, response.json()["choices"][0]

        answers = await asyncio.gather(*(ask(case) for case in SCHEMA_CORPUS))
    finished = 0
    for case, choice in answers:
        if choice["finish_reason"] != "stop":
            assert choice["finish_reason"] == "length", case.name
            continue
        finished += 1
        value = json.loads(choice["message"]["content"])
        jsonschema.validate(value, case.schema, format_checker=jsonschema.FormatChecker())
    assert finished >= len(SCHEMA_CORPUS) * 3 // 4, f"only {finished} answers finished"


async def test_an_unsupported_keyword_is_refused_by_name(smollm2_server):
    async with httpx.AsyncClient(base_url=smollm2_server.url, timeout=60) as client:
        native = await client.post(
            "/generate",
            json={
                "prompt": "x",
                "constraint": {"type": "json_schema", "schema": {"dependentSchemas": {"a": {}}}},
            },
        )
        v1 = await client.post(
            "/v1/chat/completions",
            json={
                "messages": _chat("x"),
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"unevaluatedProperties": False}},
                },
            },
        )
    assert native.status_code == 422 and "dependentSchemas" in native.json()["error"]["message"]
    assert v1.status_code == 400 and "unevaluatedProperties" in v1.json()["error"]["message"]


@pytest.mark.parametrize(
    ("prompt", "constraint", "check"),
    [
        (
            "Today's date in ISO format is",
            {"type": "regex", "pattern": "20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"},
            lambda text: re.fullmatch(r"20\d\d-\d\d-\d\d", text),
        ),
        (
            "Is the sky blue? Answer yes or no:",
            {"type": "choice", "choices": ["yes", "no", "maybe"]},
            lambda text: text in ("yes", "no", "maybe"),
        ),
    ],
)
async def test_regex_and_choice(smollm2_server, prompt, constraint, check):
    async with httpx.AsyncClient(base_url=smollm2_server.url, timeout=60) as client:
        for temperature in (0, 1.0):
            response = await client.post(
                "/generate",
                json={
                    "prompt": prompt,
                    "max_tokens": 32,
                    "temperature": temperature,
                    "constraint": constraint,
                },
            )
            body = response.json()
            assert body["finish_reason"] == "stop", body
            assert check(body["text"]), body["text"]


async def test_a_seeded_constrained_request_alone_equals_in_a_crowd(smollm2_server):
    schema = SCHEMA_CORPUS[0].schema
    seeded = {
        "prompt": "A person, as JSON: ",
        "max_tokens": 48,
        "temperature": 0.9,
        "seed": 4321,
        "constraint": {"type": "json_schema", "schema": schema},
    }
    async with httpx.AsyncClient(base_url=smollm2_server.url, timeout=120) as client:
        alone = (await client.post("/generate", json=seeded)).json()
        crowd = [
            asyncio.create_task(
                client.post(
                    "/generate",
                    json={
                        "prompt": f"Story number {i}: once upon a time" * (1 + i % 3),
                        "max_tokens": 32,
                        "ignore_eos": True,
                    },
                )
            )
            for i in range(10)
        ]
        await wait_for_queue(client, running=len(crowd), timeout=120)  # all in their slots
        in_crowd = (await client.post("/generate", json=seeded)).json()
        await asyncio.gather(*crowd)
    assert alone["token_ids"] == in_crowd["token_ids"]
    jsonschema.validate(json.loads(alone["text"]), schema)
