"""The ``tokenizer.*`` keys of a GGUF file, read once into one record.

Keys and defaults are llama.cpp's (``llama_vocab::impl::load`` in ``llama-vocab.cpp``):
``tokenizer.ggml.model`` picks the vocabulary type (``gpt2``: byte-level BPE with merges,
``llama``: SentencePiece with scores); when the BOS/EOS/UNK id keys are absent llama.cpp falls
back to 1/2/0 for ``llama`` and 11/11/none for ``gpt2``; ``add_bos_token`` defaults to true for
``llama`` and, for ``gpt2``, to what the pre-tokenizer implies (true for the Llama 3 family).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from tokenizers import AddedToken, Tokenizer

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.tokenizers.text_tokenizer import UnsupportedTokenizerError


class GGUFTokenType(IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Token types llama.cpp matches in the text before tokenizing (cache_special_tokens).
MATCHED_IN_TEXT = frozenset(
    {GGUFTokenType.CONTROL, GGUFTokenType.USER_DEFINED, GGUFTokenType.UNKNOWN}
)

SUPPORTED_MODELS = ("gpt2", "llama")

_DEFAULT_IDS = {"llama": (1, 2, 0), "gpt2": (None, None, None)}  # bos, eos, unk


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """A GGUF file's tokenizer metadata.

    Attributes:
        model: ``tokenizer.ggml.model`` ("gpt2" or "llama").
        pre: ``tokenizer.ggml.pre`` ("default" when absent, as llama.cpp reads it).
        tokens: token texts by id.
        token_types: one :class:`GGUFTokenType` per token (NORMAL when the key is absent).
        scores: SentencePiece scores by id (empty when the key is absent).
        merges: ranked BPE merges as ``(left, right)`` (empty for ``llama``).
        bos_token_id / eos_token_id / unknown_token_id: None when the model has none.
        end_of_turn_ids: ``eot_token_id`` and ``eom_token_id`` when present.
        add_bos_token / add_eos_token / add_space_prefix: None when the key is absent (the
            builder applies llama.cpp's default for the vocabulary type).
        chat_template: ``tokenizer.chat_template`` (None when absent).
    """

    model: str
    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[GGUFTokenType, ...]
    scores: tuple[float, ...]
    merges: tuple[tuple[str, str], ...]
    bos_token_id: int | None
    eos_token_id: int | None
    unknown_token_id: int | None
    end_of_turn_ids: frozenset[int]
    add_bos_token: bool | None
    add_eos_token: bool | None
    add_space_prefix: bool | None
    chat_template: str | None

    @classmethod
    def read(cls, file: GGUFFile) -> GGUFVocab:
        """The tokenizer record of ``file``.

        Raises:
            UnsupportedTokenizerError: ``tokenizer.ggml.model`` is absent or not one of
                :data:`SUPPORTED_MODELS`.
            ValueError: the token list, types and scores disagree in length, or a merge is not
                two tokens.
        """
        model = file.field_or("tokenizer.ggml.model", None)
        if model not in SUPPORTED_MODELS:
            raise UnsupportedTokenizerError(
                f"tokenizer model {model!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODELS)})"
            )
        tokens = tuple(str(t) for t in file.field("tokenizer.ggml.tokens"))
        types_field = file.field_or("tokenizer.ggml.token_type", None)
        token_types = (
            tuple(GGUFTokenType(int(t)) for t in types_field)
            if types_field is not None
            else (GGUFTokenType.NORMAL,) * len(tokens)
        )
        scores = tuple(float(s) for s in file.field_or("tokenizer.ggml.scores", ()))
        if len(token_types) != len(tokens) or (scores and len(scores) != len(tokens)):
            raise ValueError(
                f"{len(tokens)} tokens but {len(token_types)} token types and {len(scores)} scores"
            )
        bos_default, eos_default, unk_default = _DEFAULT_IDS[model]
        end_of_turn = {
            _token_id(file, key, None, len(tokens))
            for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        }
        return cls(
            model=model,
            pre=str(file.field_or("tokenizer.ggml.pre", "default")),
            tokens=tokens,
            token_types=token_types,
            scores=scores,
            merges=tuple(_split_merge(m) for m in file.field_or("tokenizer.ggml.merges", ())),
            bos_token_id=_token_id(file, "tokenizer.ggml.bos_token_id", bos_default, len(tokens)),
            eos_token_id=_token_id(file, "tokenizer.ggml.eos_token_id", eos_default, len(tokens)),
            unknown_token_id=_token_id(
                file, "tokenizer.ggml.unknown_token_id", unk_default, len(tokens)
            ),
            end_of_turn_ids=frozenset(i for i in end_of_turn if i is not None),
            add_bos_token=_flag(file, "tokenizer.ggml.add_bos_token"),
            add_eos_token=_flag(file, "tokenizer.ggml.add_eos_token"),
            add_space_prefix=_flag(file, "tokenizer.ggml.add_space_prefix"),
            chat_template=file.field_or("tokenizer.chat_template", None),
        )

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def ids_of(self, *kinds: GGUFTokenType) -> list[int]:
        """Ids of the tokens of the given types, in id order."""
        wanted = set(kinds)
        return [i for i, kind in enumerate(self.token_types) if kind in wanted]


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after the first character.
    position = merge.find(" ", 1)
    if position < 0:
        raise ValueError(f"merge {merge!r} is not two tokens")
    return merge[:position], merge[position + 1 :]


def _token_id(file: GGUFFile, key: str, default: int | None, vocab_size: int) -> int | None:
    value: Any = file.field_or(key, default)
    if value is None:
        return None
    value = int(value)
    # llama.cpp ignores an id outside the vocabulary (and -1, "none") rather than failing.
    return value if 0 <= value < vocab_size else None


def _flag(file: GGUFFile, key: str) -> bool | None:
    value = file.field_or(key, None)
    return None if value is None else bool(value)


def add_gguf_added_tokens(hf: Tokenizer, vocab: GGUFVocab) -> None:
    """Adds the file's control and unknown tokens to ``hf`` as special tokens (matched whole,
    never split, dropped by ``skip_special_tokens``) and its user-defined ones as plain added
    tokens, both unnormalised, as llama.cpp treats them."""
    hf.add_special_tokens(
        [
            AddedToken(vocab.tokens[i], special=True, normalized=False)
            for i in vocab.ids_of(GGUFTokenType.CONTROL, GGUFTokenType.UNKNOWN)
        ]
    )
    hf.add_tokens(
        [
            AddedToken(vocab.tokens[i], special=False, normalized=False)
            for i in vocab.ids_of(GGUFTokenType.USER_DEFINED)
        ]
    )
