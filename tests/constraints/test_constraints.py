"""Constraints on the mock model: every kind through /generate and /v1, refusals naming the
reason before any work, the compile cache, the matcher's lifetime (admission to finish)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import llguidance
import pytest
from harness.sse import json_events

from app.constraints import ConstraintCompiler, ConstraintError, ConstraintSpec
from app.constraints.matcher import ConstraintMatcher
from app.engine.request import SequenceStatus
from app.models.mock import MockModelRunner
from app.models.sampling.token_mask import unpack_token_masks
from tests.http.conftest import app_client, mock_config, wait_for_queue

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _compiler() -> ConstraintCompiler:
    model = MockModelRunner(max_num_seqs=1)
    return ConstraintCompiler(model.tokenizer, model.capabilities, cache_size=2)


def _allowed(mask) -> set[int]:
    return set(unpack_token_masks(mask[None, :], 257)[0].nonzero()[:, 0].tolist())


def test_a_matcher_masks_advances_and_ends():
    matcher = _compiler().compile(ConstraintSpec.choice(["yes", "no"])).new_matcher()
    assert _allowed(matcher.next_mask()) == {ord("y"), ord("n")}
    for byte in b"no":
        assert not matcher.is_finished
        assert matcher.advance(byte)
    assert matcher.is_finished
    assert _allowed(matcher.next_mask()) == {256}  # only EOS once the language is complete


def test_a_token_outside_the_language_is_refused():
    matcher = _compiler().compile(ConstraintSpec.regex("[0-9]+")).new_matcher()
    assert not matcher.advance(ord("x"))
    assert matcher.error


def test_equal_specs_share_one_compile_and_the_cache_is_bounded():
    compiler = _compiler()
    first = compiler.compile(ConstraintSpec.json_schema({"type": "integer", "minimum": 1}))
    again = compiler.compile(ConstraintSpec.json_schema({"type": "integer", "minimum": 1}))
    assert again is first
    compiler.compile(ConstraintSpec.regex("a+"))
    compiler.compile(ConstraintSpec.regex("b+"))
    assert compiler.cached == 2
    assert compiler.compile(ConstraintSpec.json_schema({"type": "integer", "minimum": 1})) is not (
        first
    )


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (
            ConstraintSpec.json_schema({"type": "object", "dependentSchemas": {}}),
            "dependentSchemas",
        ),
        (ConstraintSpec.json_schema({"type": "string", "unevaluatedItems": False}), "unevaluated"),
        (ConstraintSpec.regex("(ab"), "unclosed group"),
        (ConstraintSpec.grammar("start: missing_rule"), "missing_rule"),
        (ConstraintSpec.json_schema([1, 2]), "object or a boolean"),  # type: ignore[arg-type]
        (ConstraintSpec.json_schema(False), "allows no value"),
        (ConstraintSpec.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (ConstraintSpec.json_schema({"if": {"type": "string"}, "then": {}}), '"if"'),
        (ConstraintSpec.json_schema({"type": "string", "format": "zzz"}), "Unknown format: zzz"),
        (ConstraintSpec.json_schema({"$ref": "https://example.com/s.json"}), "example.com"),
    ],
)
def test_what_cannot_compile_is_refused_naming_the_reason(spec, reason):
    with pytest.raises(ConstraintError, match=reason):
        _compiler().compile(spec)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"type": "json"}, lambda text: isinstance(json.loads(text), dict)),
        (
            {"type": "json_schema", "schema": SCHEMA},
            lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None,
        ),
        ({"type": "choice", "choices": ["alpha", "beta"]}, lambda text: text in ("alpha", "beta")),
        (
            {"type": "regex", "pattern": "[0-9]{3}-[a-z]{2}"},
            lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text) is not None,
        ),
        (
            {"type": "grammar", "grammar": 'start: "(" num ")"\nnum: /[0-9]{1,4}/\n'},
            lambda text: re.fullmatch(r"\([0-9]{1,4}\)", text) is not None,
        ),
    ],
)
async def test_every_kind_through_generate_ends_complete_and_inside(constraint, check):
    async with app_client() as client:
        response = await client.post(
            "/generate", json={"prompt": "hello", "max_tokens": 200, "constraint": constraint}
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["finish_reason"] == "stop"
    assert check(body["text"]), body["text"]


async def test_an_objects_keys_come_in_the_schemas_order():
    """(found by a helper: the schema was compiled from sorted JSON, so "answer" came before
    "reasoning"); two schemas with their properties in other orders are two constraints."""
    properties = {"reasoning": {"type": "string", "maxLength": 8}, "answer": {"type": "integer"}}
    orders = (["reasoning", "answer"], ["answer", "reasoning"])
    async with app_client() as client:
        for order in orders:
            schema = {"type": "object", "properties": {key: properties[key] for key in order}}
            schema |= {"required": order, "additionalProperties": False}
            constraint = {"type": "json_schema", "schema": schema}
            response = await client.post(
                "/generate", json={"prompt": "a", "max_tokens": 100, "constraint": constraint}
            )
            assert response.status_code == 200, response.text
            assert list(json.loads(response.json()["text"])) == order


async def test_streamed_constrained_text_equals_the_whole_answer():
    body = {
        "prompt": "x",
        "max_tokens": 200,
        "constraint": {"type": "json_schema", "schema": SCHEMA},
    }
    async with app_client() as client:
        whole = (await client.post("/generate", json=body)).json()
        streamed = await client.post("/generate", json={**body, "stream": True})
    texts = [data["text"] for event, data in json_events(streamed.text) if event == "token"]
    assert "".join(texts) == whole["text"]


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        (
            {"type": "json_schema", "schema": {"type": "object", "dependentSchemas": {}}},
            "dependentSchemas",
        ),
        ({"type": "regex", "pattern": "(ab"}, "unclosed group"),
        ({"type": "choice", "choices": []}, "constraint.choice.choices"),
        ({"type": "yaml"}, "constraint"),
        ({"type": "regex"}, "constraint.regex.pattern"),
        ({"type": "regex", "pattern": "(a{1000}){1000}"}, "too complex to follow"),
    ],
)
async def test_bad_constraints_are_422_before_any_work(constraint, named):
    async with app_client() as client:
        response = await client.post(
            "/generate", json={"prompt": "hello", "max_tokens": 5, "constraint": constraint}
        )
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request"
        assert named in error["message"] or named in (error["param"] or "")
        assert client.model.started_prompts == []  # never reached the model


def test_a_constraint_whose_matcher_met_llguidances_limits_is_refused_from_then_on():
    """(found by a helper: a regex whose lexer outgrew llguidance's limits failed its first
    request mid-way; compiled from the cache, it then left every later request's matcher in
    error at once, whose mask allows EOS alone: 200, empty text, "stop", outside the
    constraint.) Such a language is now refused at compile when its first step meets the
    limits (the parametrized 422s above); one that meets them later marks its compiled
    constraint broken, which the cache then refuses. A token the grammar rejects (the
    engine's mask not applied) is the request's failure alone, and a matcher in error is
    never finished."""
    compiler = _compiler()
    spec = ConstraintSpec.choice(["yes", "no"])
    compiled = compiler.compile(spec)
    rejected = compiled.new_matcher()
    assert not rejected.advance(ord("q"))
    assert "doesn't satisfy the grammar" in rejected.error
    assert not rejected.is_finished
    assert compiler.compile(spec) is compiled  # not the constraint's fault
    lexer = llguidance.LLMatcher(
        compiler._ll(), ConstraintSpec.regex("(a{1000}){1000}").grammar_text()
    )
    outgrown = ConstraintMatcher(lexer, compiler.mask_words, compiled._break)
    outgrown.next_mask()
    assert not outgrown.advance(ord("a"))
    assert outgrown.error.startswith("lexer error")
    with pytest.raises(ConstraintError, match="too complex to follow: lexer error"):
        compiler.compile(spec)
    assert compiler.cached == 1  # kept: the next request is refused as fast


async def test_v1_response_format_and_the_constraint_extension():
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
    }
    chat = [{"role": "user", "content": "hi"}]
    async with app_client() as client:
        answer = await client.post(
            "/v1/chat/completions",
            json={"messages": chat, "max_tokens": 200, "response_format": schema_format},
        )
        jsonschema.validate(json.loads(answer.json()["choices"][0]["message"]["content"]), SCHEMA)
        completion = await client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 200, "response_format": {"type": "json_object"}},
        )
        assert isinstance(json.loads(completion.json()["choices"][0]["text"]), dict)
        choice = await client.post(
            "/v1/chat/completions",
            json={
                "messages": chat,
                "max_tokens": 20,
                "constraint": {"type": "choice", "choices": ["left", "right"]},
            },
        )
        assert choice.json()["choices"][0]["message"]["content"] in ("left", "right")
        both = await client.post(
            "/v1/chat/completions",
            json={
                "messages": chat,
                "response_format": {"type": "json_object"},
                "constraint": {"type": "json"},
            },
        )
        assert both.status_code == 400
        assert "not both" in both.json()["error"]["message"]
        refused = await client.post(
            "/v1/chat/completions",
            json={
                "messages": chat,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"dependentSchemas": {}}},
                },
            },
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "response_format"
        assert "dependentSchemas" in refused.json()["error"]["message"]


async def test_the_matcher_lives_from_admission_to_the_finish_funnel():
    """A cancelled constrained request drops its matcher; its slot's next request gets its own."""
    config = mock_config(max_num_seqs=1, mock_step_ms=5.0)
    async with app_client(config) as client:
        body = {
            "prompt": "hello",
            "max_tokens": 5000,
            "ignore_eos": True,
            "constraint": {"type": "regex", "pattern": "[a-z]*"},
        }
        task = asyncio.create_task(
            client.post("/generate", json=body, headers={"X-Request-Id": "long"})
        )
        await wait_for_queue(client, running=1)
        scheduler = client.app.state.resources.engine.scheduler
        (running,) = list(scheduler.running())
        assert running.matcher is not None
        assert (await client.delete("/generate/long")).status_code == 200
        assert (await task).json()["finish_reason"] == "cancelled"
        assert running.status is SequenceStatus.FINISHED and running.matcher is None
        follow = await client.post(
            "/generate",
            json={
                "prompt": "hi",
                "max_tokens": 50,
                "constraint": {"type": "choice", "choices": ["zz"]},
            },
        )
        assert follow.json()["text"] == "zz" and follow.json()["finish_reason"] == "stop"


async def test_unconstrained_rows_carry_no_mask():
    async with app_client() as client:
        seen = []
        step = client.model.step

        def recording(batch):
            seen.extend(row.token_mask is None for row in batch.rows if row.sample)
            return step(batch)

        client.model.step = recording
        await asyncio.gather(
            client.post("/generate", json={"prompt": "free", "max_tokens": 4, "ignore_eos": True}),
            client.post(
                "/generate",
                json={
                    "prompt": "tied",
                    "max_tokens": 4,
                    "constraint": {"type": "regex", "pattern": "a{4}"},
                },
            ),
        )
    assert True in seen and False in seen


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user"}, "messages.0"),
        ({"role": "assistant"}, "messages.0"),
        ({"role": "user", "content": "x", "tool_calls": []}, None),
        ({"role": "tool", "content": "x", "tool_call_id": "c1"}, None),
    ],
)
async def test_message_fields_by_role(message, param):
    async with app_client() as client:
        response = await client.post(
            "/v1/chat/completions", json={"messages": [message], "max_tokens": 1}
        )
    if param is None:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 400 and response.json()["error"]["param"] == param
