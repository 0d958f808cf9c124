"""``tool_choice: auto``: the text a stream of the output gives equals the text of the whole
output, however the output is split into pieces (found by a helper: a space or line break before
``<tool_call>`` came out of a stream, not out of the whole answer, because the split put it
before a partial tag), and so do the calls."""

from __future__ import annotations

import pytest

from app.api.openai.tools import FunctionBody, ToolBody, tool_plan
from app.api.output_reader import CallPiece, OutputReader, TextPiece

WEATHER = ToolBody(
    type="function",
    function=FunctionBody(
        name="get_weather",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    ),
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OUTPUTS = {
    "space before a call": f"Sure. {CALL}",
    "line breaks before a call, text after": f"Sure.\n\n{CALL}\nDone.",
    "a block that is no call": "Hi:\n<tool_call>not json</tool_call>",
    "an unclosed block": 'Hi <tool_call>{"name": "get_wea',
    "a tag that is not one": "a <b> and <tool c",
    "a partial tag at the end": "x  <tool",
    "trailing space": "plain text \n",
}


def read(text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    reader = OutputReader(tool_plan([WEATHER], "auto", None), None, "c_")
    pieces = []
    for start in range(0, len(text), size):
        pieces += reader.feed(text[start : start + size])
    pieces += reader.finish()
    text_out = "".join(p.text for p in pieces if isinstance(p, TextPiece))
    calls = [(p.call.name, p.call.arguments) for p in pieces if isinstance(p, CallPiece)]
    return text_out, calls


@pytest.mark.parametrize("output", OUTPUTS.values(), ids=OUTPUTS.keys())
def test_every_split_reads_as_the_whole(output: str) -> None:
    whole_reader = OutputReader(tool_plan([WEATHER], "auto", None), None, "c_")
    whole = whole_reader.read_whole(output)
    whole_text = "".join(p.text for p in whole if isinstance(p, TextPiece))
    whole_calls = [(p.call.name, p.call.arguments) for p in whole if isinstance(p, CallPiece)]
    for size in range(1, len(output) + 1):
        assert read(output, size) == (whole_text, whole_calls), f"pieces of {size}"


def test_what_the_whole_reads() -> None:
    """The space before calls is dropped; kept where the tagged text holds no call."""
    assert read(OUTPUTS["space before a call"], 10**6) == (
        "Sure.",
        [("get_weather", '{"city": "Paris"}')],
    )
    assert read(OUTPUTS["a block that is no call"], 10**6)[0] == OUTPUTS["a block that is no call"]
    assert read(OUTPUTS["an unclosed block"], 10**6) == ("Hi", [])
    assert read(OUTPUTS["a tag that is not one"], 10**6)[0] == "a <b> and <tool c"
