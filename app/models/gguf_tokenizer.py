"""The tokenizer of a GGUF file under the name ``app.models.smollm2`` imports.

The tokenizers live in :mod:`app.models.tokenizers` (use ``load_gguf_tokenizer`` there);
this module keeps ``GGUFTokenizer(file)`` working until every loader has moved.
"""

from __future__ import annotations

from app.models.gguf_file import GGUFFile
from app.models.tokenizers import END_OF_GENERATION_TEXTS, TextTokenizer, load_gguf_tokenizer
from app.models.tokenizers.gguf_vocab import GGUFTokenType

__all__ = ["END_OF_GENERATION_TEXTS", "GGUFTokenType", "GGUFTokenizer"]


class GGUFTokenizer(TextTokenizer):
    """:func:`app.models.tokenizers.load_gguf_tokenizer` of ``file``, as a class."""

    def __init__(self, file: GGUFFile) -> None:
        built = load_gguf_tokenizer(file)
        super().__init__(
            built._hf,
            token_bytes=built._token_bytes,
            bos_token_id=built.bos_token_id,
            eos_token_id=built.eos_token_id,
            end_of_generation_ids=built.eos_token_ids,
            add_bos_token=built.add_bos_token,
            add_eos_token=built.add_eos_token,
            chat_template=built.chat_template,
            kind=built.kind,
        )
