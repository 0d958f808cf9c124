"""A byte-level BPE tokenizer built from the ``tokenizer.ggml.*`` keys of a GGUF file.

Where each rule comes from:

* **Byte-level BPE (GPT-2).** ``tokenizer.ggml.model == "gpt2"``: every token string is written
  in GPT-2's printable alphabet, in which each byte 0..255 has one stand-in character (bytes
  that are printable Latin-1 stand for themselves, the other 68 are moved to U+0100 onwards,
  in byte order; the space is ``Ġ``). ``tokenizer.ggml.merges`` is the ranked merge list.
* **Pre-tokenizer ``smollm``.** ``tokenizer.ggml.pre == "smollm"`` selects, in llama.cpp's
  ``llama-vocab.cpp``, the same pre-tokenizer as ``starcoder``: the text is first split so that
  every numeric character (``\\p{N}``, which includes ``²`` and ``³``) is a piece of its own,
  then each piece is split with GPT-2's regex (contractions, optional space + letters, optional
  space + numbers, optional space + other symbols, whitespace runs). Hence ``"² ³"`` gives
  ``²``, ``" "``, ``³`` (ids 19133, 216, 39050) and ``"12345"`` gives five tokens.
  We build it as ``Split(\\p{N}, isolated)`` followed by ``ByteLevel(use_regex=True)``.
* **Special tokens.** Tokens of type CONTROL (3) and USER_DEFINED (4) are matched in the text
  before pre-tokenization and encoded as their single id, as llama.cpp does when it parses
  specials. No BOS is added (``tokenizer.ggml.add_bos_token`` is False for SmolLM2; we follow
  the key). CONTROL tokens decode to no bytes (llama.cpp renders them only on request).
* **End of generation.** ``tokenizer.ggml.eos_token_id`` plus the control tokens whose text is
  one of llama.cpp's end-of-generation markers (``<|im_end|>``, ``<|endoftext|>``, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

from tokenizers import AddedToken, Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from app.models.gguf_file import GGUFFile

# Texts llama.cpp treats as end-of-generation when they are control tokens (llama-vocab.cpp).
END_OF_GENERATION_TEXTS = frozenset(
    {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>"}
)


class GGUFTokenType(IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def _byte_stand_ins() -> dict[str, int]:
    """GPT-2's byte-level alphabet: stand-in character -> the byte it stands for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    stand_ins = {chr(byte): byte for byte in printable}
    next_code_point = 256
    for byte in range(256):
        if byte not in printable:
            stand_ins[chr(next_code_point)] = byte
            next_code_point += 1
    return stand_ins


def _token_text_to_bytes(text: str, stand_ins: dict[str, int]) -> bytes:
    return bytes(stand_ins[char] for char in text)


class GGUFTokenizer:
    """The :class:`app.models.base.Tokenizer` of a GGUF file with a ``gpt2`` tokenizer model.

    Attributes:
        eos_token_ids: ids that end generation.
        chat_template: the Jinja chat template string from the file (None when absent).
        bos_token_id: ``tokenizer.ggml.bos_token_id`` (None when absent).
    """

    def __init__(self, file: GGUFFile) -> None:
        model_kind = file.field("tokenizer.ggml.model")
        if model_kind != "gpt2":
            raise ValueError(f"only byte-level BPE ('gpt2') is supported, got {model_kind!r}")
        pre = file.field_or("tokenizer.ggml.pre", "default")
        if pre != "smollm":
            raise ValueError(f"only the 'smollm' pre-tokenizer is implemented, got {pre!r}")
        if file.field_or("tokenizer.ggml.add_bos_token", False):
            raise ValueError("add_bos_token=True is not supported")

        tokens: list[str] = list(file.field("tokenizer.ggml.tokens"))
        token_types = [GGUFTokenType(t) for t in file.field("tokenizer.ggml.token_type")]
        merges = [tuple(merge.split(" ", 1)) for merge in file.field("tokenizer.ggml.merges")]
        self._vocab_size = len(tokens)

        self._hf = HFTokenizer(
            models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        )
        self._hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        specials = [
            AddedToken(tokens[i], special=True, normalized=False, single_word=False)
            for i, kind in enumerate(token_types)
            if kind in (GGUFTokenType.CONTROL, GGUFTokenType.USER_DEFINED)
        ]
        self._hf.add_special_tokens(specials)

        stand_ins = _byte_stand_ins()
        self._token_bytes: list[bytes] = [
            b""
            if kind is GGUFTokenType.CONTROL
            else text.encode("utf-8")
            if kind is GGUFTokenType.USER_DEFINED
            else _token_text_to_bytes(text, stand_ins)
            for text, kind in zip(tokens, token_types, strict=True)
        ]

        eos_id = int(file.field("tokenizer.ggml.eos_token_id"))
        self.eos_token_ids = frozenset(
            {eos_id}
            | {
                i
                for i, kind in enumerate(token_types)
                if kind is GGUFTokenType.CONTROL and tokens[i] in END_OF_GENERATION_TEXTS
            }
        )
        bos = file.field_or("tokenizer.ggml.bos_token_id", None)
        self.bos_token_id: int | None = None if bos is None else int(bos)
        self.chat_template: str | None = file.field_or("tokenizer.chat_template", None)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their single id.

        Goes through ``encode_batch``, which releases the GIL while the Rust tokenizer works
        (``encode`` holds it: measured, a 1 MB prompt held it 0.8 s), so a long prompt
        tokenized on a worker thread does not stall the event loop."""
        return self._hf.encode_batch([text], add_special_tokens=False)[0].ids

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        """Raw UTF-8 bytes of the tokens (control tokens give b""); may end mid-character.

        Raises:
            IndexError: an id outside ``[0, vocab_size)``.
        """
        token_bytes = self._token_bytes
        for token_id in token_ids:
            if not 0 <= token_id < self._vocab_size:
                raise IndexError(f"token id {token_id} outside [0, {self._vocab_size})")
        return b"".join(token_bytes[token_id] for token_id in token_ids)

    def token_text(self, token_id: int) -> str:
        """The token's text with invalid UTF-8 replaced (for logs and tests)."""
        return self._token_bytes[token_id].decode("utf-8", errors="replace")
