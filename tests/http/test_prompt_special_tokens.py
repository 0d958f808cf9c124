"""A raw prompt gets the BOS its tokenizer adds; a chat prompt does not when the model's own
template wrote one, and does when the ChatML fallback renders it (which writes none)."""

from __future__ import annotations

from app.models.mock import ByteTokenizer
from tests.http.conftest import RecordingMock, app_client, mock_config

BOS = 2  # a byte the mock's prompts never hold, standing for a Llama tokenizer's BOS


class BosTokenizer(ByteTokenizer):
    """The mock's byte tokenizer with a BOS before every raw prompt (``add_bos_token``)."""

    def encode(self, text: str) -> list[int]:
        return [BOS, *super().encode(text)]

    def encode_without_special_tokens(self, text: str) -> list[int]:
        return super().encode(text)


class TemplatedBosTokenizer(BosTokenizer):
    """The same with a chat template of its own, which writes the BOS itself."""

    chat_template = (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    bos_token = chr(BOS)


async def test_a_chat_prompt_is_encoded_without_a_second_bos() -> None:
    config = mock_config()
    model = RecordingMock(
        max_num_seqs=config.max_num_seqs, step_ms=0.0, context_length=config.mock_context_length
    )
    model.tokenizer = TemplatedBosTokenizer()
    async with app_client(config, model=model) as client:
        for path, body in (
            ("/generate", {"prompt": "hi"}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            response = await client.post(path, json={**body, "max_tokens": 1})
            assert response.status_code == 200, response.text
    generate, completion, chat = model.started_prompts
    assert generate == completion == bytes([BOS]) + b"hi"
    assert chat.startswith(bytes([BOS]) + b"<|im_start|>user\nhi")  # the template's, once
    assert chat.count(bytes([BOS])) == 1


async def test_the_chatml_fallback_gets_the_bos_a_plain_prompt_gets() -> None:
    config = mock_config()
    model = RecordingMock(
        max_num_seqs=config.max_num_seqs, step_ms=0.0, context_length=config.mock_context_length
    )
    model.tokenizer = BosTokenizer()  # no chat template: the fallback
    async with app_client(config, model=model) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    (chat,) = model.started_prompts
    assert chat.startswith(bytes([BOS]) + b"<|im_start|>user\nhi")
