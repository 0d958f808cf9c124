"""Reasoning content: ``<think>`` blocks split out of answers as ``reasoning_content`` (chat),
a ``reasoning`` item (responses) and a ``thinking`` block (messages). The splitter on its own
(every split of a text), scripted models (one byte a token, so every tag is cut across
tokens: a template that opens the block, a model that writes it, a stop string and a length cut
inside it, ``chat_template_kwargs``), then SmolLM2 with a ``--chat-template`` that opens it."""

from __future__ import annotations

import anthropic
import openai
import pytest
from harness.threaded_server import serve_in_thread
from pydantic import ValidationError

from app.api.reasoning import ReasoningParser, ReasoningSplit, ReasoningSplitter
from app.api.server import create_app
from app.engine.chat_template import CHATML_TEMPLATE
from tests.http.conftest import mock_config
from tests.http.scripted_model import ScriptedModel

# ChatML whose assistant turn opens a <think> block, unless enable_thinking is false (then it
# writes an empty one, as Qwen3's template does).
THINK_TEMPLATE = CHATML_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}",
)
# A template that mentions <think> (as Qwen3's does) but leaves opening it to the model.
MENTIONS_THINK = "{# a model that writes <think> itself #}" + CHATML_TEMPLATE
ASK = [{"role": "user", "content": "What is 6 times 7?"}]
SCRIPT = "Six sevens.\nThat is 42.</think>\n\nThe answer is 42."


def split_all(splitter: ReasoningSplitter, text: str, cut: int) -> ReasoningSplit:
    parts = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.finish()]
    return ReasoningSplit(
        "".join(part.reasoning for part in parts), "".join(part.content for part in parts)
    )


@pytest.mark.parametrize("cut", range(len(SCRIPT) + 1))
def test_the_split_is_the_same_wherever_the_text_is_cut(cut):
    assert split_all(ReasoningSplitter(inside=True), SCRIPT, cut) == ReasoningSplit(
        "Six sevens.\nThat is 42.", "The answer is 42."
    )
    written = " <think>" + SCRIPT
    assert split_all(ReasoningSplitter(inside=False), written, cut) == ReasoningSplit(
        "Six sevens.\nThat is 42.", "The answer is 42."
    )


def test_unclosed_blocks_plain_answers_and_the_parser_setting():
    assert split_all(ReasoningSplitter(inside=True), "Six sev</thi", 5) == ReasoningSplit(
        "Six sev</thi", ""
    )
    assert split_all(ReasoningSplitter(inside=False), "<thi", 2) == ReasoningSplit("", "<thi")
    assert split_all(ReasoningSplitter(inside=False), "Hi <think>", 2) == ReasoningSplit(
        "", "Hi <think>"
    )
    assert ReasoningParser.of("auto", THINK_TEMPLATE).enabled
    assert not ReasoningParser.of("auto", CHATML_TEMPLATE).enabled
    assert ReasoningParser.of("think", CHATML_TEMPLATE).enabled
    assert not ReasoningParser.of("none", THINK_TEMPLATE).enabled
    parser = ReasoningParser(enabled=True)
    assert parser.start("<|im_start|>assistant\n<think>\n", constrained=True) is None
    opened = parser.start("<|im_start|>assistant\n<think>\n", constrained=False)
    assert opened is not None and opened.feed("a</think>b") == ReasoningSplit("a", "b")
    closed = parser.start("assistant\n<think>\n\n</think>\n\n", constrained=False)
    assert closed is not None and closed.feed("a</think>b") == ReasoningSplit("", "a</think>b")
    # a user's message that ends with the tag did not open the answer's block (found by a
    # helper: the whole answer came back as reasoning_content)
    user_tag = "Explain this tag: <think><|im_end|>\n<|im_start|>assistant\n"
    asked = parser.start(user_tag, constrained=False)
    assert asked is not None
    assert split_all(asked, "It opens one.", 3) == ReasoningSplit("", "It opens one.")


def _openai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def think_server(script: str, template: str, **overrides):
    model = ScriptedModel(script, template, max_num_seqs=2)
    return model, serve_in_thread(create_app(mock_config(max_num_seqs=2, **overrides), model=model))


async def streamed_chat(client: openai.AsyncOpenAI, **request) -> tuple[str, str, str | None]:
    reasoning = content = ""
    finish = None
    async with await client.chat.completions.create(**request, stream=True) as stream:
        async for chunk in stream:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish


async def test_chat_answers_with_a_template_that_opens_the_block():
    model, running = think_server(SCRIPT, THINK_TEMPLATE)
    with running as server:
        client = _openai(server.url)
        request = {"model": "m", "messages": ASK, "max_tokens": 200}
        answer = await client.chat.completions.create(**request)
        message = answer.choices[0].message
        assert message.model_extra["reasoning_content"] == "Six sevens.\nThat is 42."
        assert message.content == "The answer is 42."
        assert await streamed_chat(client, **request) == (
            "Six sevens.\nThat is 42.",
            "The answer is 42.",
            "stop",
        )

        cut = await client.chat.completions.create(**{**request, "max_tokens": 8})
        assert cut.choices[0].finish_reason == "length"
        assert cut.choices[0].message.model_extra["reasoning_content"] == "Six seve"
        assert cut.choices[0].message.content is None
        assert await streamed_chat(client, **{**request, "max_tokens": 8}) == (
            "Six seve",
            "",
            "length",
        )

        events = [
            event
            async for event in await client.responses.create(
                model="m", input="6x7?", max_output_tokens=8, stream=True
            )
        ]
        incomplete = events[-1].response
        assert events[-1].type == "response.incomplete" and incomplete.output_text == ""
        assert [item.type for item in incomplete.output] == ["reasoning", "message"]
        assert incomplete.output[0].content[0].text == "Six seve"
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert added == ["reasoning", "message"]

        stopped = await client.chat.completions.create(**request, stop=["42"])
        assert stopped.choices[0].message.model_extra["reasoning_content"] == (
            "Six sevens.\nThat is "
        )
        assert stopped.choices[0].message.content is None

        off = await client.chat.completions.create(
            **request, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        assert model.prompts[-1].endswith("<think>\n\n</think>\n\n")
        assert off.choices[0].message.content == SCRIPT
        assert "reasoning_content" not in off.choices[0].message.model_extra


async def test_a_model_that_writes_the_block_and_every_wire_format():
    model, running = think_server("<think>\nSix sevens.\n</think>\n\nIt is 42.", MENTIONS_THINK)
    with running as server:
        client = _openai(server.url)
        answer = await client.chat.completions.create(model="m", messages=ASK, max_tokens=200)
        message = answer.choices[0].message
        assert message.model_extra["reasoning_content"] == "\nSix sevens.\n"
        assert message.content == "It is 42."

        response = await client.responses.create(model="m", input="What is 6 times 7?")
        reasoning, text = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "\nSix sevens.\n"
        assert response.output_text == "It is 42."
        # the block's tokens, tags included (one a byte here; found by a helper: always 0)
        block = len("<think>\nSix sevens.\n</think>")
        assert response.usage.output_tokens_details.reasoning_tokens == block
        deltas = []
        async with client.responses.stream(model="m", input="What is 6 times 7?") as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            streamed = await stream.get_final_response()
        assert "".join(deltas) == "It is 42." and streamed.output_text == "It is 42."
        assert [item.type for item in streamed.output] == ["reasoning", "message"]
        assert streamed.output[0].content[0].text == "\nSix sevens.\n"
        # the answer's output goes back as the next turn's input, reasoning item and all (found
        # by a helper: the reasoning item was a 400); the reasoning is not rendered again
        follow_up = [
            {"role": "user", "content": "What is 6 times 7?"},
            *(item.model_dump(exclude_none=True) for item in response.output),
            {"role": "user", "content": "And 6 times 8?"},
        ]
        again = await client.responses.create(model="m", input=follow_up)
        assert again.output_text == "It is 42."
        assert "It is 42." in model.prompts[-1] and "Six sevens" not in model.prompts[-1]

        messages = anthropic.AsyncAnthropic(base_url=server.url, api_key="none", max_retries=0)
        whole = await messages.messages.create(model="m", max_tokens=200, messages=ASK)
        assert [block.type for block in whole.content] == ["thinking", "text"]
        assert whole.content[0].thinking == "\nSix sevens.\n"
        assert whole.content[1].text == "It is 42."
        events = [
            event
            async for event in await messages.messages.create(
                model="m", max_tokens=200, messages=ASK, stream=True
            )
        ]
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
        assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts == ["thinking", "text"]

    none_model, running = think_server("<think>x</think>y", MENTIONS_THINK, reasoning_parser="none")
    with running as server:
        plain = await _openai(server.url).chat.completions.create(
            model="m", messages=ASK, max_tokens=50
        )
        assert plain.choices[0].message.content == "<think>x</think>y"


def test_chat_template_file_is_checked(tmp_path):
    missing = tmp_path / "missing.jinja"
    with pytest.raises(ValidationError, match="cannot read"):
        mock_config(chat_template=str(missing))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for %}")
    with pytest.raises(ValidationError, match="not a valid Jinja template"):
        mock_config(chat_template=str(broken))
    binary = tmp_path / "model.bin"  # valid UTF-8 and a valid template, but binary
    binary.write_bytes(b"GGUF\x03\x00\x00\x00 weights")
    with pytest.raises(ValidationError, match="NUL byte"):
        mock_config(chat_template=str(binary))
    constant = tmp_path / "constant.jinja"  # the same prompt whatever the conversation
    constant.write_text("{{ bos_token }}Hello{% if add_generation_prompt %}!{% endif %}")
    with pytest.raises(ValidationError, match="never reads `messages`"):
        mock_config(chat_template=str(constant))
    looped = tmp_path / "looped.jinja"
    looped.write_text("{% set turns = messages %}{% for m in turns %}{{ m.content }}{% endfor %}")
    assert mock_config(chat_template=str(looped)).chat_template == str(looped)


@pytest.mark.slow
async def test_smollm2_with_a_chat_template_that_opens_the_block(tmp_path, smollm2_runner):
    template = tmp_path / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    config = mock_config(max_num_seqs=2, chat_template=str(template))
    app = create_app(config, model=smollm2_runner)
    with serve_in_thread(app) as server:
        client = _openai(server.url)
        request = {"model": "smollm2", "messages": ASK, "max_tokens": 40, "temperature": 0}
        answer = await client.chat.completions.create(**request)
        message = answer.choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert reasoning and "<think>" not in reasoning
        assert "<think>" not in (message.content or "")
        streamed = await streamed_chat(client, **request)
        assert streamed == (reasoning, message.content or "", answer.choices[0].finish_reason)
