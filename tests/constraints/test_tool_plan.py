"""ToolPlan on its own: which constraint each tool_choice asks for, and how outputs are read
back (complete, cut short, tagged among text, unknown functions ignored)."""

from __future__ import annotations

import json

from app.api.openai.tools import FunctionBody, NamedToolChoice, ToolBody, ToolMode, tool_plan
from app.constraints import ConstraintKind

TOOLS = [
    ToolBody(type="function", function=FunctionBody(name="add", parameters={"type": "object"})),
    ToolBody(type="function", function=FunctionBody(name="now")),
]


def test_each_choice_asks_for_its_constraint():
    assert tool_plan(None, None, None) is None
    assert tool_plan(TOOLS, None, None).mode is ToolMode.AUTO
    assert tool_plan(TOOLS, "auto", None).constraint() is None
    assert tool_plan(TOOLS, "none", None).constraint() is None
    required = tool_plan(TOOLS, "required", False).constraint()
    assert required.kind is ConstraintKind.JSON_SCHEMA
    array = json.loads(required.source)
    assert array["maxItems"] == 1 and len(array["items"]["anyOf"]) == 2
    assert "maxItems" not in json.loads(tool_plan(TOOLS, "required", None).constraint().source)
    named = tool_plan(
        TOOLS,
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "now"}}),
        None,
    )
    assert json.loads(named.constraint().source)["additionalProperties"] is False


def test_outputs_read_back():
    required = tool_plan(TOOLS, "required", None)
    calls, content = required.read_calls('[{"name": "add", "arguments": {"a": 1}}]', "c_")
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [("c_0", "add", {"a": 1})]
    assert content is None
    assert required.read_calls('[{"name": "add", "argu', "c_") == ([], '[{"name": "add", "argu')
    assert required.read_calls('{"name": "add"}', "c_") == ([], '{"name": "add"}')
    auto = tool_plan(TOOLS, "auto", False)
    text = (
        'Sure. <tool_call>{"name": "now", "arguments": {}}</tool_call> and '
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>not json</tool_call>'
    )
    calls, content = auto.read_calls(text, "c_")
    assert [c.name for c in calls] == ["now"]  # parallel_tool_calls false: the first only
    assert content == "Sure.  and"
    assert len(tool_plan(TOOLS, "auto", None).read_calls(text, "c_")[0]) == 2
    assert auto.read_calls("no calls here", "c_") == ([], "no calls here")
