"""The GGUF tokenizer against llama.cpp's rules for SmolLM2 (byte-level BPE, smollm pre-type)."""

from __future__ import annotations

import pytest

from app.models.tokenizers import TextTokenizer


def test_superscripts_split_like_llama_cpp(tokenizer: TextTokenizer) -> None:
    # llama.cpp's reference tokenizer; transformers' GGUF loader gives [19133, 3351, 128].
    assert tokenizer.encode("² ³") == [19133, 216, 39050]


def test_every_digit_is_its_own_token(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("12345")
    assert len(ids) == 5
    assert [tokenizer.decode_bytes([i]) for i in ids] == [b"1", b"2", b"3", b"4", b"5"]


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        "  leading spaces, trailing spaces  \n\n\ttabs\r\n",
        "東京は日本の首都です。北京是中国的首都。",
        "emoji 🎉👍🏽 and flags 🇫🇷",
        "don't you'll I'm O'Neil",
        "",
    ],
)
def test_encode_then_decode_gives_the_text_back(tokenizer: TextTokenizer, text: str) -> None:
    assert tokenizer.decode_bytes(tokenizer.encode(text)) == text.encode("utf-8")


def test_special_tokens_in_a_prompt_are_one_id_each(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|endoftext|>")
    assert ids[0] == 1
    assert 2 in ids and ids[-1] == 0
    assert tokenizer.encode("<|im_start|>") == [1]


def test_control_tokens_decode_to_no_bytes(tokenizer: TextTokenizer) -> None:
    assert tokenizer.decode_bytes([1, 4093, 2]) == b"user"
    # /detokenize keeps them, as vLLM's does (found by a helper: a chat's /tokenize ids came
    # back from /detokenize without their template markers)
    text = "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
    assert tokenizer.decode_bytes_with_special_tokens(tokenizer.encode(text)) == text.encode()
    assert tokenizer.decode_bytes_with_special_tokens([4093]) == b"user"
    with pytest.raises(IndexError):
        tokenizer.decode_bytes_with_special_tokens([tokenizer.vocab_size])


def test_a_character_split_over_tokens_reassembles(tokenizer: TextTokenizer) -> None:
    text = "🎉"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode_bytes([i]) for i in ids]
    assert len(ids) > 1
    with pytest.raises(UnicodeDecodeError):
        pieces[0].decode("utf-8")
    assert b"".join(pieces).decode("utf-8") == text


def test_end_of_generation_ids_and_chat_template(tokenizer: TextTokenizer) -> None:
    assert tokenizer.eos_token_ids == frozenset({0, 2})  # <|endoftext|>, <|im_end|>
    assert tokenizer.vocab_size == 49152
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template


def test_decoding_an_id_outside_the_vocabulary_raises(tokenizer: TextTokenizer) -> None:
    with pytest.raises(IndexError):
        tokenizer.decode_bytes([49152])


def test_encode_is_the_hf_tokenizers_encode(tokenizer: TextTokenizer) -> None:
    """``encode`` goes through ``encode_batch`` (it releases the GIL); same ids as ``encode``."""
    for text in ("The capital of France is", "² ³ 12345", "<|im_start|>user\nhi", "", "é" * 50):
        expected = tokenizer._hf.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text) == expected
