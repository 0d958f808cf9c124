"""A raw prompt gets the BOS its tokenizer adds; a chat prompt does not, its template wrote one."""

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


async def test_a_chat_prompt_is_encoded_without_a_second_bos() -> None:
    config = mock_config()
    model = RecordingMock(
        max_num_seqs=config.max_num_seqs, step_ms=0.0, context_length=config.mock_context_length
    )
    model.tokenizer = BosTokenizer()
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
    assert chat.startswith(b"<|im_start|>user\nhi") and bytes([BOS]) not in chat
