"""Tool calls cut by ``max_tokens``: the calls completed before the cut come back as
``tool_calls`` (each with arguments that parse), the partial one is dropped, never raw JSON as
``content``; streamed and not. ``OutputReader`` on its own (pieces in any split), then the
issue's case on SmolLM2 through the ``openai`` SDK."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from app.api.openai.tools import FunctionBody, NamedToolChoice, ToolBody, tool_plan
from app.api.output_reader import (
    ArgumentsPiece,
    CallHead,
    CallPiece,
    JsonArrayItems,
    OutputReader,
    RequiredCallStream,
    TextPiece,
)
from tests.constraints.test_tools import ASK, PARAMETERS, TIME, WEATHER

TOOLS = [
    ToolBody(type="function", function=FunctionBody(name="add", parameters={"type": "object"})),
    ToolBody(type="function", function=FunctionBody(name="now")),
]
TWO_CALLS = '[{"name": "add", "arguments": {"a": "]}"}}, {"name": "now", "arguments": {}}]'


def read_in_pieces(reader: OutputReader, text: str, size: int) -> list:
    pieces = []
    for start in range(0, len(text), size):
        pieces += reader.feed(text[start : start + size])
    return pieces + reader.finish()


def calls_of(pieces: list) -> list[tuple[str, str, object]]:
    return [
        (p.call.id, p.call.name, json.loads(p.call.arguments))
        for p in pieces
        if isinstance(p, CallPiece)
    ]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_required_calls_come_out_as_each_completes(size):
    reader = OutputReader(tool_plan(TOOLS, "required", None), None, "c_")
    pieces = read_in_pieces(reader, TWO_CALLS, size)
    assert calls_of(pieces) == [("c_0", "add", {"a": "]}"}), ("c_1", "now", {})]
    assert not [p for p in pieces if isinstance(p, TextPiece)]


def streamed_calls(text: str, size: int) -> dict[int, list[str]]:
    """RequiredCallStream over ``text`` fed ``size`` characters at a time: per call index,
    [id, name, arguments text]; a head always comes before its pieces."""
    stream = RequiredCallStream("c_")
    calls: dict[int, list[str]] = {}
    for start in range(0, len(text), size):
        for piece in stream.feed(text[start : start + size]):
            if isinstance(piece, CallHead):
                assert piece.index not in calls
                calls[piece.index] = [piece.id, piece.name, ""]
            else:
                assert isinstance(piece, ArgumentsPiece) and piece.index in calls
                calls[piece.index][2] += piece.text
    return calls


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_required_calls_stream_their_name_then_argument_pieces(size):
    spaced = '[ {"name":"add" ,"arguments" : {"a": "]}\\"x", "b": [1, {"c": 2}]} } ,'
    spaced += '{"arguments": {}, "name": "now"}]'
    for text, expected in (
        (TWO_CALLS, [("c_0", "add", {"a": "]}"}), ("c_1", "now", {})]),
        (spaced, [("c_0", "add", {"a": ']}"x', "b": [1, {"c": 2}]}), ("c_1", "now", {})]),
    ):
        calls = streamed_calls(text, size)
        got = [(calls[i][0], calls[i][1], json.loads(calls[i][2])) for i in sorted(calls)]
        assert got == [(i, n, a) for i, n, a in expected]


@pytest.mark.parametrize("cut", range(1, len(TWO_CALLS)))
def test_a_streamed_cut_has_sent_the_completed_calls_whole(cut):
    """A stream cut by the length limit: every call completed before the cut was streamed
    whole (its pieces parse to its arguments); the partial one's pieces are a prefix."""
    calls = streamed_calls(TWO_CALLS[:cut], 1)
    whole = OutputReader(tool_plan(TOOLS, "required", None), None, "c_").read_whole(TWO_CALLS[:cut])
    for done in calls_of(whole):
        index = int(done[0].removeprefix("c_"))
        assert (calls[index][0], calls[index][1], json.loads(calls[index][2])) == done
    full = streamed_calls(TWO_CALLS, 1000)
    for index, (_, _, arguments) in calls.items():
        assert full[index][2].startswith(arguments)


@pytest.mark.parametrize("cut", range(1, len(TWO_CALLS)))
def test_a_cut_keeps_the_completed_calls_and_drops_the_partial_one(cut):
    plan = tool_plan(TOOLS, "required", None)
    pieces = OutputReader(plan, None, "c_").read_whole(TWO_CALLS[:cut])
    assert all(isinstance(piece, CallPiece) for piece in pieces)  # never text
    first_done = TWO_CALLS.index("}}") + 2
    assert len(pieces) == (cut >= first_done) + (cut >= len(TWO_CALLS) - 1)


def test_named_and_auto_cuts_drop_the_partial_call():
    named = tool_plan(
        TOOLS,
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}}),
        None,
    )
    assert OutputReader(named, None, "c_").read_whole('{"a": 1') == []
    assert calls_of(OutputReader(named, None, "c_").read_whole('{"a": 1}')) == [
        ("c_0", "add", {"a": 1})
    ]
    auto = tool_plan(TOOLS, "auto", None)
    text = 'Sure. <tool_call>{"name": "now", "arguments": {}}</tool_call> <tool_call>{"name": "a'
    pieces = OutputReader(auto, None, "c_").read_whole(text)
    assert pieces[0] == TextPiece("Sure.") and calls_of(pieces[1:]) == [("c_0", "now", {})]
    assert OutputReader(auto, None, "c_").read_whole("Plain <tool_ca") == [
        TextPiece("Plain <tool_ca")
    ]


def test_json_array_items_follow_strings_and_escapes():
    items = JsonArrayItems()
    assert items.feed('[{"s": "a\\"}, {') == []
    done = items.feed('"}, {"t": [1, {"u": 2}]}')
    assert [json.loads(item) for item in done] == [{"s": 'a"}, {'}, {"t": [1, {"u": 2}]}]


# --------------------------------------------------------------------------- SmolLM2


def _sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.slow
async def test_required_calls_cut_by_max_tokens_on_smollm2(smollm2_server):
    """The issue's case: parallel calls cut by the length limit came back as content JSON."""
    client = _sdk(smollm2_server.url)
    request = {
        "model": "smollm2",
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        # a whole call, then the second cut (greedy on SmolLM2; 80 tokens made three and a cut)
        "max_tokens": 48,
        "temperature": 0,
    }
    whole = await client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    for call in choice.message.tool_calls or ():
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])

    # streamed as generated (API.md): each call's name first, then its arguments in pieces;
    # the calls the whole answer kept were streamed whole, the cut one only begun
    calls: dict[int, list[str]] = {}
    content = ""
    heads = 0
    async with await client.chat.completions.create(**request, stream=True) as stream:
        async for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or ():
                if piece.function.name:  # the head: id and name, no arguments yet
                    calls[piece.index] = [piece.function.name, ""]
                    heads += piece.id is not None and not piece.function.arguments
                calls[piece.index][1] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason
    assert finish == "length" and content == ""
    kept = choice.message.tool_calls or ()
    assert heads == len(calls)  # each call's name went out before its arguments
    for index, call in enumerate(kept):
        name, arguments = calls[index]
        assert (name, json.loads(arguments)) == (
            call.function.name,
            json.loads(call.function.arguments),
        )
    assert len(calls) in (len(kept), len(kept) + 1)
