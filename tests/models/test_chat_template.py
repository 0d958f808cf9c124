"""Chat templates: our Jinja rendering against transformers', and a chat on the real model."""

from __future__ import annotations

import logging

import pytest

from app.engine.chat_template import (
    CHATML_TEMPLATE,
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    syntax_error,
)
from app.engine.prompt_encoder import PromptEncoder
from app.models.mock import ByteTokenizer
from tests.checkpoints import smollm2_transformers_tokenizer
from tests.http.conftest import app_client, mock_config

CONVERSATION = (
    ChatMessage("system", "You answer in one short sentence."),
    ChatMessage("user", "Hi! Who are you?"),
    ChatMessage("assistant", "I am a small assistant."),
    ChatMessage("user", "What is 2 + 2? Answer with <b>one</b> word, « s'il vous plaît »."),
)

# Whitespace control, loop controls, namespace, tojson, bos/eos: what Hub templates use.
TRICKY_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') %}
{% for message in messages %}
  {% if message['role'] == 'system' %}
    {% set ns.system = message['content'] %}
    {% continue %}
  {% endif %}
  [{{ loop.index0 }}] {{ message['role'] | upper }}: {{ message['content'] | tojson }}
  {% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}
{% endfor %}
system={{ ns.system | tojson }}
{% if add_generation_prompt %}[next] ASSISTANT:{% endif %}"""


def as_dicts(messages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def test_model_without_template_gets_chatml():
    template = ChatTemplate.of(ByteTokenizer())
    assert not template.from_model and template.source == CHATML_TEMPLATE
    rendered = template.render([ChatMessage("system", "S"), ChatMessage("user", "U")])
    assert rendered == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_rendering_matches_transformers_on_a_tricky_template():
    from transformers.utils.chat_template_utils import render_jinja_template

    class Tokenizer:
        chat_template = TRICKY_TEMPLATE
        bos_token = "<s>"
        eos_token = "</s>"

    ours = ChatTemplate.of(Tokenizer()).render(CONVERSATION)
    (theirs,), _ = render_jinja_template(
        conversations=[as_dicts(CONVERSATION)],
        chat_template=TRICKY_TEMPLATE,
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )
    assert ours == theirs
    assert ours.startswith("<s>") and "</s>" in ours and "« s'il vous plaît »" in ours


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),  # a refusal
        ("{{ messages.__class__.__mro__ }}", "SecurityError"),  # the sandbox
        ("{% set _ = messages.append(1) %}", "SecurityError"),
        # a template whose own code fails on a conversation: the request's error, not a 500
        # with a traceback (found by a helper with a --chat-template file)
        ("{{ (1 / 0) }}", "ZeroDivisionError: division by zero"),
        ("{{ messages[0].content.parts[0].text }}", "UndefinedError"),
    ],
)
def test_template_refusal_sandbox_and_failure(source, error):
    class Template:
        chat_template = source

    with pytest.raises(ChatTemplateError, match=error):
        ChatTemplate.of(Template()).render(CONVERSATION)


def test_a_models_template_that_is_not_jinja_falls_back_to_chatml(caplog):
    """(found by a helper: a GGUF whose template does not parse started without a word, and
    every chat was then a 400 blaming its messages.) The model's own template that does not
    parse is replaced by ChatML, as llama.cpp's server does, with a warning naming the
    parser's reason; one given with --chat-template is checked when it is read instead."""

    class Broken:
        chat_template = "{% for m in messages %}{{ m.content }"
        bos_token = eos_token = ""

        def encode(self, text: str) -> list[int]:
            return list(text.encode())

    with caplog.at_level(logging.WARNING):
        encoder = PromptEncoder(Broken(), "tiny")
    assert not encoder.chat_template.from_model
    assert "<|im_start|>user\nhi<|im_end|>" in encoder.chat_template.render(
        [ChatMessage("user", "hi")]
    )
    assert "tiny's chat template is not valid Jinja" in caplog.text
    assert syntax_error("{{ messages }}") is None


# --------------------------------------------------------------------------- the real model


@pytest.fixture
def smollm2(runner):
    """The session's SmolLM2 (``tests/models/conftest.py``), not a load of its own."""
    return runner


@pytest.mark.slow
def test_gguf_template_renders_like_transformers(smollm2):
    reference = smollm2_transformers_tokenizer()  # converted from the GGUF once per session
    template = ChatTemplate.of(smollm2.tokenizer)
    assert template.from_model and template.source == reference.chat_template

    ours = template.render(CONVERSATION)
    theirs = reference.apply_chat_template(
        as_dicts(CONVERSATION), tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    # and the prompt we submit is the token sequence transformers would feed the model
    assert smollm2.tokenizer.encode(ours) == reference.encode(ours, add_special_tokens=False)


@pytest.mark.slow
async def test_greedy_chat_on_the_real_model_knows_paris(smollm2):
    async with app_client(mock_config(max_num_seqs=2), model=smollm2) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0,
                "max_tokens": 24,
            },
        )
        assert response.status_code == 200, response.text
        body = response.json()
        answer = body["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        assert body["model"] == "SmolLM2-135M-Instruct"
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert 0 < body["usage"]["completion_tokens"] <= 24
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["chat_template"] == "model"
