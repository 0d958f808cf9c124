"""The tokenizer every loader in this package returns: a Hugging Face ``tokenizers`` pipeline plus
what the server needs around it (raw token bytes, BOS/EOS rules, end-of-generation ids, the chat
template).

It satisfies :class:`app.models.base.Tokenizer` and adds what the API and the chat template
renderer read: ``encode_without_special_tokens`` (for a prompt a chat template rendered, which
writes BOS itself), ``bos_token``/``eos_token`` (texts) and ``chat_template``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as HFTokenizer

# Texts llama.cpp treats as end of generation, whatever the token's type (llama-vocab.cpp,
# where it collects special_eog_ids; it also forces those tokens to CONTROL).
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)


class UnsupportedTokenizerError(ValueError):
    """A tokenizer this package cannot build (an unknown GGUF tokenizer model or pre-tokenizer,
    a tokenizer.json decoder it cannot turn into bytes). The message is one line that names it."""


class TextTokenizer:
    """Text -> token ids -> raw bytes, for one model.

    Attributes:
        eos_token_ids: ids that end generation: the EOS id, the file's end-of-turn ids and every
            token whose text is in :data:`END_OF_GENERATION_TEXTS`.
        bos_token_id / eos_token_id: the model's BOS and EOS ids (None when it has none).
        add_bos_token / add_eos_token: whether :meth:`encode` puts them around a prompt.
        chat_template: the Jinja chat template (None when the model has none).
        kind: what built it, for logs (``"gguf gpt2/smollm"``, ``"gguf llama"``,
            ``"tokenizer.json"``).
    """

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        token_bytes: Sequence[bytes],
        bos_token_id: int | None,
        eos_token_id: int | None,
        end_of_generation_ids: frozenset[int] = frozenset(),
        add_bos_token: bool,
        add_eos_token: bool,
        chat_template: str | None,
        kind: str,
    ) -> None:
        """
        Args:
            hf: the whole text -> ids pipeline, special tokens included.
            token_bytes: ``token_bytes[i]`` is what id ``i`` decodes to (b"" for control
                tokens); its length is the vocabulary size.
            end_of_generation_ids: more ids that end generation, besides EOS and the ones named
                by :data:`END_OF_GENERATION_TEXTS`.

        Raises:
            ValueError: BOS (EOS) is to be added but the model has no BOS (EOS) id.
        """
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token is true but the tokenizer has no BOS token")
        if add_eos_token and eos_token_id is None:
            raise ValueError("add_eos_token is true but the tokenizer has no EOS token")
        self._hf = hf
        self._token_bytes = tuple(token_bytes)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        self.kind = kind
        vocab_size = len(self._token_bytes)
        named = {
            token_id
            for text in END_OF_GENERATION_TEXTS
            if (token_id := hf.token_to_id(text)) is not None and token_id < vocab_size
        }
        eos = {eos_token_id} if eos_token_id is not None else set()
        self.eos_token_ids = frozenset(
            i for i in eos | named | end_of_generation_ids if 0 <= i < vocab_size
        )

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    @property
    def bos_token(self) -> str | None:
        """BOS as text (what a chat template writes as ``bos_token``)."""
        return None if self.bos_token_id is None else self._hf.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """EOS as text (what a chat template writes as ``eos_token``)."""
        return None if self.eos_token_id is None else self._hf.id_to_token(self.eos_token_id)

    def encode(self, text: str) -> list[int]:
        """The ids of a raw prompt: BOS first and EOS last when the model's metadata says so
        (``add_bos_token``/``add_eos_token``, as llama.cpp's server and vLLM do for
        completions); special tokens written in the text become their single id."""
        return self.encode_batch([text])[0]

    def encode_without_special_tokens(self, text: str) -> list[int]:
        """The ids of ``text`` with no BOS/EOS added (vLLM's ``add_special_tokens=False``): for a
        prompt rendered by a chat template, which writes BOS itself. Special tokens written in
        the text still become their single id."""
        return self.encode_batch([text], add_special_tokens=False)[0]

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """:meth:`encode` (or, with ``add_special_tokens=False``,
        :meth:`encode_without_special_tokens`) of each text.

        Goes through ``tokenizers``' ``encode_batch``, which releases the GIL while the Rust
        tokenizer works (``encode`` holds it: measured, a 1 MB prompt held it 0.8 s), so a long
        prompt tokenized on a worker thread does not stall the event loop."""
        encodings = self._hf.encode_batch(list(texts), add_special_tokens=False)
        ids = [encoding.ids for encoding in encodings]
        if add_special_tokens and self.add_bos_token:
            ids = [[self.bos_token_id, *row] for row in ids]
        if add_special_tokens and self.add_eos_token:
            ids = [[*row, self.eos_token_id] for row in ids]
        return ids

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        """Raw bytes of the tokens, concatenated; may end mid-character
        (``app.engine.detokenizer`` reassembles). Control tokens give b"".

        Raises:
            IndexError: an id outside ``[0, vocab_size)``.
        """
        token_bytes = self._token_bytes
        vocab_size = len(token_bytes)
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise IndexError(f"token id {token_id} outside [0, {vocab_size})")
        return b"".join(token_bytes[token_id] for token_id in token_ids)

    def decode_bytes_with_special_tokens(self, token_ids: Sequence[int]) -> bytes:
        """:meth:`decode_bytes`, with each control token as its own text (``<|im_start|>``, BOS,
        EOS): what ``/detokenize`` answers, as vLLM's (a tokenizer's ``decode`` keeps them).

        Raises:
            IndexError: an id outside ``[0, vocab_size)``.
        """
        raw = self.decode_bytes(token_ids)  # checks the ids
        if all(self._token_bytes[token_id] for token_id in token_ids):
            return raw
        return b"".join(
            self._token_bytes[token_id] or (self._hf.id_to_token(token_id) or "").encode()
            for token_id in token_ids
        )

    def token_text(self, token_id: int) -> str:
        """The token's bytes as text, invalid UTF-8 replaced (for logs and tests).

        Raises:
            IndexError: an id outside ``[0, vocab_size)``.
        """
        return self.decode_bytes((token_id,)).decode("utf-8", errors="replace")
