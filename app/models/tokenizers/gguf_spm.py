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

import hashlib
import os
import pickle
import re
from array import array
from operator import itemgetter

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers

from app.models.kernels.build import cache_dir
from app.models.tokenizers.gguf_vocab import GGUFTokenType, GGUFVocab, add_gguf_added_tokens
from app.models.tokenizers.text_tokenizer import TextTokenizer

SPACE = "\u2581"  # ▁
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_MERGEABLE = (GGUFTokenType.NORMAL, GGUFTokenType.UNDEFINED)
# Vocabularies from this size on keep their ranked merges on disk (cached_spm_merges): Gemma 3's
# 262k tokens take ~1.2 s to rank and 0.15 s to read back; Llama 2's 32k, 0.15 s to rank.
CACHE_FROM_TOKENS = 100_000


def spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's score-driven merging, best first: every split
    of a mergeable token into two mergeable tokens, ranked by the token's score (highest
    first), then its id, then where it is cut (the tokens sorted once, each followed by its
    splits in order: the ids make the order total). Gemma 3's 262k tokens have 513k splits,
    ~1.2 s of Python, most of it finding them: see :func:`cached_spm_merges`."""
    scores = vocab.scores
    rank = {
        token: (-(scores[i] if scores else 0.0), i)
        for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True))
        if kind in _MERGEABLE
    }
    merges: list[tuple[str, str]] = []
    add = merges.append
    for token, _ in sorted(rank.items(), key=itemgetter(1)):
        for cut in range(1, len(token)):
            left = token[:cut]
            if left in rank:
                right = token[cut:]
                if right in rank:
                    add((left, right))
    return merges


def cached_spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """:func:`spm_merges` of a large vocabulary (``CACHE_FROM_TOKENS``), ranked once per
    machine and kept in the cache directory (``$SLOTSERVE_CACHE_DIR``, default
    ``~/.cache/slotserve``, beside the compiled kernels) under a hash of its tokens, their
    types and scores, as a pickle (the directory is trusted as the kernels' libraries there
    are). A cache file that cannot be read is ranked again; one that cannot be written is
    skipped."""
    if len(vocab.tokens) < CACHE_FROM_TOKENS:
        return spm_merges(vocab)
    digest = hashlib.sha256("\x00".join(vocab.tokens).encode("utf-8", "surrogatepass"))
    digest.update(array("d", vocab.scores).tobytes())
    digest.update(bytes(vocab.token_types))
    path = cache_dir() / f"spm-merges-{digest.hexdigest()[:32]}.pickle"
    try:
        with path.open("rb") as file:
            merges = pickle.load(file)
        if isinstance(merges, list):
            return merges
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError):
        pass
    merges = spm_merges(vocab)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with partial.open("wb") as file:
            pickle.dump(merges, file, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, path)  # whole or absent, for a process reading it meanwhile
    except OSError:
        partial.unlink(missing_ok=True)
    return merges


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
            merges=cached_spm_merges(vocab),
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
