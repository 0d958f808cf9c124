"""The deterministic mock model of ``seeds/003``: stateless, one next token per full prefix.

``MockModel.next_tokens`` is the seed's contract as written: every call receives each sequence's
whole token prefix and returns one token per entry, keeping nothing between calls.
``MockModelRunner`` adapts it to the scheduler's ``Model`` protocol; like a real model's KV cache,
it keeps each slot's prefix between steps, and it drops that state on ``release``.

Tokens are bytes: ids 0..255 are the UTF-8 bytes of the text (so a multi-byte character really is
split over several tokens), 256 is EOS.

The mock "speaks" characters of a small alphabet that includes 2-, 3- and 4-byte UTF-8
characters. For a prefix whose last character is incomplete it emits that character's next byte;
otherwise it hashes the prefix (CRC-32 of its length and last 32 tokens) and either ends (EOS,
1 chance in ``eos_one_in``) or starts the alphabet character the hash picks. So outputs are
deterministic per prompt, their lengths are uneven (geometric), and different prompts give
different text.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Sequence

import torch

from app.models.base import ModelCapabilities, StepBatch, StepOutput, TokenLogprobs
from app.models.token_mask import unpack_token_masks

MOCK_EOS_TOKEN_ID = 256
MOCK_FAIL_MARKER = b"<<fail>>"
MOCK_VOCAB_SIZE = 257
_ALPHABET = tuple("abcdefghijklmnopqrstuvwxyz      .,éß中文😀")
_ALPHABET_BYTES = tuple(ch.encode("utf-8") for ch in _ALPHABET)


def _utf8_length(lead: int) -> int:
    """Bytes in the UTF-8 character that starts with ``lead`` (1 for anything else)."""
    if lead >= 0xF0:
        return 4
    if lead >= 0xE0:
        return 3
    if lead >= 0xC0:
        return 2
    return 1


def _incomplete_tail(prefix: Sequence[int]) -> bytes:
    """The bytes of an unfinished UTF-8 character at the end of ``prefix`` (b"" if none)."""
    for back in range(1, min(4, len(prefix)) + 1):
        token = prefix[-back]
        if token >= 256:
            return b""
        if token & 0xC0 != 0x80:  # a lead byte or ASCII
            if back < _utf8_length(token):
                return bytes(prefix[-back:])
            return b""
    return b""


class MockModel:
    """Stateless and deterministic: ``next_tokens`` depends only on each entry's prefix.

    Args:
        eos_one_in: on each completed character, EOS comes with probability 1/eos_one_in
            (decided by the hash), so mean output length is about this many characters.
    """

    def __init__(self, eos_one_in: int = 24) -> None:
        self.eos_one_in = eos_one_in

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        """batch[i] is the token prefix of one sequence. Returns one next token per entry."""
        return [self._next(prefix) for prefix in batch]

    def _next(self, prefix: Sequence[int]) -> int:
        tail = _incomplete_tail(prefix)
        if tail:
            for encoded in _ALPHABET_BYTES:
                if encoded.startswith(tail):
                    return encoded[len(tail)]
            return ord("?")  # a prompt's own broken tail (cannot happen for valid UTF-8)
        # Hash the length and the last 32 tokens: a function of the whole prefix that costs
        # O(1) per token, so long generations stay cheap.
        tail_bytes = bytes(token & 0xFF for token in prefix[-32:])
        digest = zlib.crc32(tail_bytes, len(prefix) & 0xFFFFFFFF)
        if digest % self.eos_one_in == 0:
            return MOCK_EOS_TOKEN_ID
        return _ALPHABET_BYTES[(digest // self.eos_one_in) % len(_ALPHABET_BYTES)][0]


def _within(mask: torch.Tensor, token: int, prefix: Sequence[int]) -> int:
    """The mock's token under a constraint's mask (``app.models.token_mask``'s layout): its own
    when allowed, else EOS when the language may end, else an allowed token picked by a hash
    of the prefix (deterministic, like the rest of the mock)."""
    allowed = unpack_token_masks(mask[None, :], MOCK_VOCAB_SIZE)[0]
    if allowed[token]:
        return token
    if allowed[MOCK_EOS_TOKEN_ID]:
        return MOCK_EOS_TOKEN_ID
    choices = allowed.nonzero()[:, 0].tolist()
    if not choices:
        return token  # nothing allowed: the scheduler finds the token outside the language
    digest = zlib.crc32(bytes(t & 0xFF for t in prefix[-32:]), len(prefix) & 0xFFFFFFFF)
    return choices[digest % len(choices)]


class ByteTokenizer:
    """One token per UTF-8 byte; EOS (256) decodes to nothing."""

    vocab_size = MOCK_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        return bytes(token for token in token_ids if token < 256)


class MockModelRunner:
    """``Model`` protocol over ``MockModel``: keeps each slot's prefix, one model call a step.

    Args:
        max_num_seqs: slots.
        context_length: most tokens per sequence.
        step_ms: sleep per step in ms, to stand in for a real model's step time.
        max_tokens_per_row: prompt chunk size the scheduler may use.
        eos_one_in: see ``MockModel``.
        fail_every: fault injection: every ``fail_every``-th step raises (0: never). Rows whose
            prefix contains ``<<fail>>`` fail on their own (``StepOutput.row_errors``).

    Attributes:
        num_model_calls: ``next_tokens`` calls so far (for static-vs-continuous comparisons).
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        context_length: int = 8192,
        step_ms: float = 0.0,
        max_tokens_per_row: int | None = None,
        eos_one_in: int = 24,
        fail_every: int = 0,
    ) -> None:
        self.model = MockModel(eos_one_in=eos_one_in)
        self.fail_every = fail_every
        self.tokenizer = ByteTokenizer()
        self.capabilities = ModelCapabilities(
            name="mock-bytes",
            backend="mock",
            context_length=context_length,
            max_num_seqs=max_num_seqs,
            vocab_size=MOCK_VOCAB_SIZE,
            eos_token_ids=frozenset({MOCK_EOS_TOKEN_ID}),
            keeps_kv_cache=False,
            max_tokens_per_row=max_tokens_per_row or context_length,
        )
        self.step_ms = step_ms
        self.num_model_calls = 0
        self._prefixes: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self._marked: list[bool] = [False] * max_num_seqs  # prompt carries MOCK_FAIL_MARKER
        self._lock = threading.Lock()

    def step(self, batch: StepBatch) -> StepOutput:
        """Raises ValueError when a row's position does not continue its slot's prefix, and
        RuntimeError on an injected whole-step failure. Inert rows (``StepRow.padding``)
        leave their slot alone and get None."""
        if batch.has_inert_rows:
            return batch.expand(self.step(batch.compacted()))
        with self._lock:
            self.num_model_calls += 1
            if self.fail_every and self.num_model_calls % self.fail_every == 0:
                raise RuntimeError(f"injected failure of mock step {self.num_model_calls}")
            for row in batch.rows:
                prefix = self._prefixes[row.slot]
                if row.position == 0:
                    prefix.clear()
                elif row.position != len(prefix):
                    raise ValueError(
                        f"slot {row.slot}: row at position {row.position}, state has {len(prefix)}"
                    )
                prefix.extend(row.token_ids)
                if row.position == 0:
                    self._marked[row.slot] = MOCK_FAIL_MARKER in bytes(
                        t for t in row.token_ids if t < 256
                    )
            errors = tuple(
                "injected failure of this request" if self._marked[row.slot] else None
                for row in batch.rows
            )
            sampled = [i for i, row in enumerate(batch.rows) if row.sample and errors[i] is None]
            if self.step_ms > 0:
                time.sleep(self.step_ms / 1000.0)
            prefixes = [self._prefixes[batch.rows[i].slot] for i in sampled]  # read-only
            tokens = self.model.next_tokens(prefixes) if prefixes else []
            result: list[int | None] = [None] * len(batch.rows)
            for index, token in zip(sampled, tokens, strict=True):
                mask = batch.rows[index].token_mask
                result[index] = token if mask is None else _within(mask, token, prefixes[index])
            return StepOutput(
                tuple(result), errors if any(errors) else None, _certain_logprobs(batch, result)
            )

    def release(self, slot: int) -> None:
        with self._lock:
            self._prefixes[slot] = []
            self._marked[slot] = False


def _certain_logprobs(
    batch: StepBatch, tokens: list[int | None]
) -> tuple[TokenLogprobs | None, ...] | None:
    """The mock's logprobs: its next token is certain (log-probability 0, the only
    alternative with any probability), for the rows that asked; None when none did."""
    if not any(row.sampling.logprobs is not None for row in batch.rows):
        return None
    return tuple(
        None
        if token is None or row.sampling.logprobs is None
        else TokenLogprobs(token, 0.0, ((token, 0.0),) if row.sampling.logprobs else ())
        for row, token in zip(batch.rows, tokens, strict=True)
    )
