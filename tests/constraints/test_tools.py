"""Tool calls through the official ``openai`` SDK: ``required`` and a named function on SmolLM2
(arguments validate against the parameters' schema), a streamed call reassembling to the same
arguments, ``auto`` read from a model's ``<tool_call>`` output with a tool-aware template, and
the tool round trip (the call and its result rendered in the next request)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from harness.threaded_server import serve_in_thread

from app.api.server import create_app
from app.engine.chat_template import CHATML_TEMPLATE
from app.models.base import StepBatch, StepOutput
from app.models.mock import MOCK_EOS_TOKEN_ID, ByteTokenizer, MockModelRunner
from tests.http.conftest import mock_config

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _valid(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.slow
async def test_required_and_named_on_smollm2(smollm2_server):
    client = _sdk(smollm2_server.url)
    required = await client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _valid(choice.message.tool_calls[0])

    named = await client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0,
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "tool_calls"
    _valid(call)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_a_streamed_call_reassembles_to_the_same_arguments(smollm2_server, tool_choice):
    client = _sdk(smollm2_server.url)
    request = {
        "model": "smollm2",
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_tokens": 80,
        "temperature": 0,
    }
    whole = await client.chat.completions.create(**request)
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    async with await client.chat.completions.create(**request, stream=True) as stream:
        async for chunk in stream:
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or ():
                if piece.function.name:
                    names[piece.index] = piece.function.name
                arguments[piece.index] = arguments.get(piece.index, "") + (
                    piece.function.arguments or ""
                )
    calls = whole.choices[0].message.tool_calls
    assert finish == "tool_calls"
    assert [names[i] for i in sorted(names)] == [call.function.name for call in calls]
    assert [arguments[i] for i in sorted(arguments)] == [call.function.arguments for call in calls]


# A tool-aware ChatML template (Hermes/Qwen style): tools in the system turn, tool results as
# their own turns, an assistant's calls as <tool_call> blocks.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}"
    "{{ tool['function'] | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls', []) %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCRIPT = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "celsius"}}</tool_call>'
)


class ToolTemplateTokenizer(ByteTokenizer):
    chat_template = TOOL_TEMPLATE


class ScriptedToolModel(MockModelRunner):
    """Answers every prompt with ``SCRIPT`` (then EOS), and keeps the prompts it was given."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tokenizer = ToolTemplateTokenizer()
        self.prompts: list[bytes] = []
        self._written = [0] * self.capabilities.max_num_seqs

    def step(self, batch: StepBatch) -> StepOutput:
        tokens: list[int | None] = []
        for row in batch.rows:
            if row.position == 0:
                self._written[row.slot] = 0
                self.prompts.append(bytes(t for t in row.token_ids if t < 256))
            if not row.sample:
                tokens.append(None)
                continue
            written = self._written[row.slot]
            script = SCRIPT.encode()
            tokens.append(script[written] if written < len(script) else MOCK_EOS_TOKEN_ID)
            self._written[row.slot] = written + 1
        return StepOutput.of_token_ids(tokens)


async def test_auto_reads_the_models_tool_call_and_the_result_goes_back():
    model = ScriptedToolModel(max_num_seqs=2)
    app = create_app(mock_config(max_num_seqs=2), model=model)
    with serve_in_thread(app) as server:
        client = _sdk(server.url)
        answer = await client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=200
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        (call,) = choice.message.tool_calls
        assert "index" not in call.to_dict()  # a stream's pieces carry it, a message's calls not
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
        # the template rendered the tools
        assert b'"name": "get_weather"' in model.prompts[-1]

        streamed = []
        async with await client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], max_tokens=200, stream=True
        ) as stream:
            async for chunk in stream:
                streamed.extend(chunk.choices[0].delta.tool_calls or () if chunk.choices else ())
        assert [piece.function.arguments for piece in streamed] == [call.function.arguments]

        follow_up = [
            *ASK,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
        ]
        await client.chat.completions.create(
            model="m", messages=follow_up, tools=[WEATHER], max_tokens=5
        )
        rendered = model.prompts[-1].decode()
        assert "<tool_call>" in rendered and '"city": "Paris"' in rendered
        assert '<|im_start|>tool\n{"celsius": 21}<|im_end|>' in rendered

        none = await client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=200
        )
        assert none.choices[0].message.tool_calls is None
        assert none.choices[0].message.content == SCRIPT


async def test_a_template_without_tools_gets_them_in_a_system_message():
    model = ScriptedToolModel(max_num_seqs=1)
    model.tokenizer = ByteTokenizer()  # ChatML: no tools in its template
    app = create_app(mock_config(max_num_seqs=1), model=model)
    with serve_in_thread(app) as server:
        await _sdk(server.url).chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], max_tokens=3
        )
    rendered = model.prompts[-1].decode()
    assert rendered.startswith("<|im_start|>system\nYou may call")
    assert '"get_weather"' in rendered and "<tool_call>" in rendered
    assert CHATML_TEMPLATE  # the fallback in use
