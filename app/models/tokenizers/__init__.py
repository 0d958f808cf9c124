"""Tokenizers for the models we serve, built with Hugging Face ``tokenizers``.

* :func:`load_gguf_tokenizer`: a GGUF file's ``tokenizer.*`` keys: byte-level BPE (``gpt2``)
  with llama.cpp's pre-tokenizers, or SentencePiece (``llama``).
* :func:`load_hf_tokenizer`: a Hugging Face directory's ``tokenizer.json`` and config files.

Both return a :class:`TextTokenizer`.
"""

from __future__ import annotations

from app.models.tokenizers.gguf_loader import load_gguf_tokenizer
from app.models.tokenizers.hf_json import load_hf_tokenizer
from app.models.tokenizers.text_tokenizer import (
    END_OF_GENERATION_TEXTS,
    TextTokenizer,
    UnsupportedTokenizerError,
)

__all__ = [
    "END_OF_GENERATION_TEXTS",
    "TextTokenizer",
    "UnsupportedTokenizerError",
    "load_gguf_tokenizer",
    "load_hf_tokenizer",
]
