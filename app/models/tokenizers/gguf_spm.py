"""SentencePiece BPE from a GGUF file (``tokenizer.ggml.model == "llama"``: TinyLlama, Llama 2,
Mistral), tokenized as llama.cpp's ``llm_tokenizer_spm`` does.

llama.cpp's rules (``llama-vocab.cpp``), and how we build each with Hugging Face ``tokenizers``:

* **Spaces.** Every ``" "`` becomes ``"▁"``; with ``add_space_prefix`` (default true) a ``" "``
  is put in front of the text and after every special token (its ``is_prev_special``). We use
  ``normalizers.Sequence([Prepend("▁"), Replace(" ", "▁")])``: ``tokenizers`` takes special
  tokens out first and normalizes each piece between them, so the prefix lands where
  llama.cpp puts it. Nothing else is normalized (Llama's models use SentencePiece's
  ``identity`` rule).
* **Merges.** No merge list: llama.cpp starts from single characters and keeps merging the
  adjacent pair whose concatenation is the vocabulary token with the highest score (the
  leftmost on a tie). A BPE merge ranks those pairs the same way: every split of every token
  into two tokens is a merge, ranked by the token's score, best first (as transformers'
  ``SentencePieceExtractor`` does). Only NORMAL tokens are merge results. Where two different
  tokens have exactly the same score the rank falls back to the token id, not to the position
  in the text (SentencePiece's own BPE scores are distinct).
* **Byte fallback.** A character that is not a token becomes its UTF-8 bytes as the BYTE
  tokens ``<0xNN>`` (``BPE(byte_fallback=True)``).
* **Special tokens.** CONTROL, USER_DEFINED and UNKNOWN tokens are matched in the text first.
  BOS is added when ``add_bos_token`` (default true), EOS when ``add_eos_token`` (default false).
* **Decoding.** ``▁`` is a space, ``<0xNN>`` the byte 0xNN, CONTROL/UNKNOWN/UNUSED tokens nothing,
  USER_DEFINED tokens their text (stored pre-normalized). No leading space is stripped: a
  generated token's space is part of the continuation.
"""

from __future__ import annotations

import re

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers

from app.models.tokenizers.gguf_vocab import GGUFTokenType, GGUFVocab, add_gguf_added_tokens
from app.models.tokenizers.text_tokenizer import TextTokenizer

SPACE = "\u2581"  # ▁
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_MERGEABLE = (GGUFTokenType.NORMAL, GGUFTokenType.UNDEFINED)


def spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's score-driven merging, best first."""
    score_by_token = {
        token: (vocab.scores[i] if vocab.scores else 0.0, i)
        for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True))
        if kind in _MERGEABLE
    }
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, (score, token_id) in score_by_token.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in score_by_token and right in score_by_token:
                ranked.append((-score, token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def spm_token_bytes(text: str, kind: GGUFTokenType) -> bytes:
    """What one SentencePiece token decodes to."""
    if kind in (GGUFTokenType.CONTROL, GGUFTokenType.UNKNOWN, GGUFTokenType.UNUSED):
        return b""
    if kind is GGUFTokenType.BYTE:
        match = _BYTE_TOKEN.fullmatch(text)
        return bytes((int(match.group(1), 16),)) if match else text.encode("utf-8")
    if kind is GGUFTokenType.USER_DEFINED:
        return text.encode("utf-8")
    return text.replace(SPACE, " ").encode("utf-8")


def build_gguf_spm(vocab: GGUFVocab) -> TextTokenizer:
    """The tokenizer of a ``llama`` (SentencePiece) GGUF vocabulary.

    Raises:
        ValueError: ``vocab`` is not a ``llama`` vocabulary, or it adds BOS/EOS without one.
    """
    if vocab.model != "llama":
        raise ValueError(f"expected a llama vocabulary, got {vocab.model!r}")
    unknown = None if vocab.unknown_token_id is None else vocab.tokens[vocab.unknown_token_id]
    hf = HFTokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(vocab.tokens)},
            merges=spm_merges(vocab),
            unk_token=unknown,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = True if vocab.add_space_prefix is None else vocab.add_space_prefix
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    add_gguf_added_tokens(hf, vocab)
    return TextTokenizer(
        hf,
        token_bytes=[
            spm_token_bytes(text, kind)
            for text, kind in zip(vocab.tokens, vocab.token_types, strict=True)
        ],
        bos_token_id=vocab.bos_token_id,
        eos_token_id=vocab.eos_token_id,
        end_of_generation_ids=vocab.end_of_turn_ids,
        add_bos_token=True if vocab.add_bos_token is None else vocab.add_bos_token,
        add_eos_token=bool(vocab.add_eos_token),
        chat_template=vocab.chat_template,
        kind="gguf llama",
    )
