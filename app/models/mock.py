"""The deterministic mock model of ``seeds/003``: stateless, one next token per full prefix.

``MockModel.next_tokens`` is the seed's contract as written: every call receives each sequence's
whole token prefix and returns one token per entry, keeping nothing between calls.
``MockModelRunner`` adapts it to the scheduler's ``Model`` protocol; like a real model's KV cache,
it keeps each slot's prefix between steps, and it drops that state on ``release``. Given
``kv_blocks`` it is paged like the real runner: it keeps the tokens of every block of a pool
(its stand-in for K/V), writes each row's tokens where the row's block table says and, for a
row that starts a sequence after a cached prefix, reads that prefix back from the blocks. Its
outputs depend only on the prefix it read, so a wrong block table or a stale block shows as
different text: with prefix caching on and off, its outputs must be the same (the oracle).

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
from array import array
from collections.abc import Sequence

import torch

from app.models.base import (
    NULL_BLOCK,
    ModelCapabilities,
    RowOutput,
    StepBatch,
    StepOutput,
    StepRow,
    TokenLogprobs,
)
from app.models.sampling.token_mask import unpack_token_masks
from app.models.sampling.verification import accepted_length

MOCK_EOS_TOKEN_ID = 256
MOCK_FAIL_MARKER = b"<<fail>>"
MOCK_VOCAB_SIZE = 257
MOCK_KV_BLOCK_SIZE = 16
# What --kv-cache-memory buys in the mock: one int32 token id per position.
MOCK_BYTES_PER_POSITION = 4
# A block position never written holds this (never a token).
_UNWRITTEN = -1
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
        order: 0 hashes the prefix's length and last 32 tokens (text that never repeats);
            ``n`` > 0 hashes only the last ``n`` tokens, a Markov chain whose text soon
            repeats itself (what n-gram speculation drafts well: tests of acceptance).
    """

    def __init__(self, eos_one_in: int = 24, order: int = 0) -> None:
        self.eos_one_in = eos_one_in
        self.order = order

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        """batch[i] is the token prefix of one sequence. Returns one next token per entry."""
        return [self.next_token_at(prefix, len(prefix)) for prefix in batch]

    def next_token_at(self, tokens: Sequence[int], end: int) -> int:
        """``next_tokens([tokens[:end]])[0]`` without copying the prefix (a prompt's logprobs
        ask at every position): the token depends on ``end`` and the last 32 (``order``)."""
        return self._next(tokens[max(0, end - max(32, self.order)) : end], end)

    def _next(self, prefix: Sequence[int], length: int) -> int:
        """The next token after a prefix of ``length`` tokens whose last ones are ``prefix``."""
        tail = _incomplete_tail(prefix)
        if tail:
            for encoded in _ALPHABET_BYTES:
                if encoded.startswith(tail):
                    return encoded[len(tail)]
            return ord("?")  # a prompt's own broken tail (cannot happen for valid UTF-8)
        # Hash the length and the last 32 tokens: a function of the whole prefix that costs
        # O(1) per token, so long generations stay cheap.
        if self.order:
            digest = zlib.crc32(_low_bytes(prefix[-self.order :]))
        else:
            digest = zlib.crc32(_low_bytes(prefix[-32:]), length & 0xFFFFFFFF)
        if digest % self.eos_one_in == 0:
            return MOCK_EOS_TOKEN_ID
        return _ALPHABET_BYTES[(digest // self.eos_one_in) % len(_ALPHABET_BYTES)][0]


def _low_bytes(tokens: Sequence[int]) -> bytes:
    """The low byte of each token (EOS, 256, gives 0): ``bytes`` of the list at C speed when
    every token is a byte, as almost every tail is; the same bytes either way."""
    try:
        return bytes(tokens)
    except ValueError:  # a token >= 256 (EOS in an ignore_eos text)
        return bytes(token & 0xFF for token in tokens)


def _within(mask: torch.Tensor, token: int, prefix: Sequence[int]) -> int:
    """The mock's token under a constraint's mask (``app.models.sampling.token_mask``'s layout):
    its own
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
    digest = zlib.crc32(_low_bytes(prefix[-32:]), len(prefix) & 0xFFFFFFFF)
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
        step_ms: how long a step takes, in ms, to stand in for a real model's step time: the
            mock sleeps what its own work leaves of it (none when that work takes longer).
        max_tokens_per_row: prompt chunk size the scheduler may use.
        eos_one_in: see ``MockModel``.
        fail_every: fault injection: every ``fail_every``-th step raises (0: never). Rows whose
            prefix contains ``<<fail>>`` fail on their own (``RowOutput.error``).
        kv_blocks: blocks of ``MOCK_KV_BLOCK_SIZE`` positions in a paged pool, the null block
            included; None: not paged (per-slot prefixes only).
        order: see ``MockModel``.

    A speculative row (``StepRow.num_draft_tokens``) is verified greedily, the mock being
    deterministic: its token after each of the row's last ``k + 1`` positions, the drafted
    tokens accepted while they agree (:func:`accepted_length`), the rest rolled back.

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
        kv_blocks: int | None = None,
        order: int = 0,
    ) -> None:
        self.model = MockModel(eos_one_in=eos_one_in, order=order)
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
            kv_block_size=MOCK_KV_BLOCK_SIZE if kv_blocks else 0,
            num_kv_blocks=kv_blocks or 0,
            verifies_drafts=True,
        )
        self.step_ms = step_ms
        self.num_model_calls = 0
        self._prefixes: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self._marked: list[bool] = [False] * max_num_seqs  # prompt carries MOCK_FAIL_MARKER
        self._in_prompt: set[int] = set()  # slots whose sequence has sampled nothing yet
        # The pool: the token at each position of each block (4 bytes a position, as
        # MOCK_BYTES_PER_POSITION says), position p of block b at b * MOCK_KV_BLOCK_SIZE + p.
        self._num_blocks = kv_blocks or 0
        self._pool = array("i", [_UNWRITTEN]) * (self._num_blocks * MOCK_KV_BLOCK_SIZE)
        self._lock = threading.Lock()

    def step(self, batch: StepBatch) -> StepOutput:
        """Raises ValueError when a row's position does not continue its slot's prefix, and
        RuntimeError on an injected whole-step failure. Inert rows (``StepRow.padding``)
        leave their slot alone and get None. A paged mock raises ValueError too for a row
        without a block table, a table naming the null block or a block outside the pool, not
        covering the row, or a cached prefix that reads a position never written."""
        if batch.has_inert_rows:
            return batch.expand(self.step(batch.compacted()))
        ends_at = time.perf_counter() + self.step_ms / 1000.0
        with self._lock:
            self.num_model_calls += 1
            if self.fail_every and self.num_model_calls % self.fail_every == 0:
                raise RuntimeError(f"injected failure of mock step {self.num_model_calls}")
            if self._num_blocks:
                for row in batch.rows:
                    self._check_blocks(row)
            for row in batch.rows:
                prefix = self._prefixes[row.slot]
                if row.starts_sequence:
                    prefix[:] = self._read_blocks(row) if row.position else []
                    if row.kv_blocks and row.kv_blocks.generated_token_ids:
                        self._in_prompt.discard(row.slot)  # recomputed: no prompt logprobs
                    else:
                        self._in_prompt.add(row.slot)
                elif row.position != len(prefix):
                    raise ValueError(
                        f"slot {row.slot}: row at position {row.position}, state has {len(prefix)}"
                    )
                prefix.extend(row.token_ids)
                self._write_blocks(row)
                if row.starts_sequence:
                    self._marked[row.slot] = MOCK_FAIL_MARKER in bytes(t for t in prefix if t < 256)
            errors = tuple(
                "injected failure of this request" if self._marked[row.slot] else None
                for row in batch.rows
            )
            sampled = [i for i, row in enumerate(batch.rows) if row.sample and errors[i] is None]
            prefixes = [self._prefixes[batch.rows[i].slot] for i in sampled]  # read-only
            prompt_logprobs = {  # prompt chunks of requests that asked, before they sample
                row.slot: self._prompt_logprobs(row)
                for row in batch.rows
                if row.sampling.prompt_logprobs is not None and row.slot in self._in_prompt
            }
            tokens = self.model.next_tokens(prefixes) if prefixes else []
            result: list[int | None] = [None] * len(batch.rows)
            accepted = [0] * len(batch.rows)
            for index, prefix, token in zip(sampled, prefixes, tokens, strict=True):
                row = batch.rows[index]
                self._in_prompt.discard(row.slot)
                if row.num_draft_tokens:
                    accepted[index], token = self._verify(row)
                mask = row.token_mask
                result[index] = token if mask is None else _within(mask, token, prefix)
            asked = any(
                row.sampling.logprobs is not None or row.sampling.prompt_logprobs is not None
                for row in batch.rows
            )
            if not asked and not any(row.num_draft_tokens for row in batch.rows):
                output = StepOutput(tuple(map(RowOutput, result, errors)))
            else:
                output = StepOutput(
                    tuple(
                        RowOutput(
                            token,
                            error,
                            _certain_logprobs(row, token),
                            prompt_logprobs=prompt_logprobs.get(row.slot),
                            num_accepted=count,
                            draft_logprobs=_certain_draft_logprobs(row, count),
                        )
                        for row, token, error, count in zip(
                            batch.rows, result, errors, accepted, strict=True
                        )
                    )
                )
            # Every row's work is done before the sleep, so the step returns when its time is
            # up, as a model whose kernels end with the step would (work after the sleep ran
            # past it: 10.27 ms for a 10 ms step at 64 rows).
            if (rest := ends_at - time.perf_counter()) > 0:
                time.sleep(rest)
            return output

    def _verify(self, row: StepRow) -> tuple[int, int]:
        """A speculative row: (drafted tokens accepted, the model's own next token); the
        slot's prefix is cut back to the accepted positions."""
        prefix = self._prefixes[row.slot]
        draft = row.draft_token_ids
        first = len(prefix) - len(draft)  # the prefix that the first sample follows
        targets = [self.model.next_token_at(prefix, first + i) for i in range(len(draft) + 1)]
        count = accepted_length(draft, targets)
        del prefix[first + count :]
        return count, targets[count]

    def _prompt_logprobs(self, row: StepRow) -> tuple[TokenLogprobs | None, ...]:
        """A prompt chunk's entries (its request asked for ``prompt_logprobs``): None for the
        prompt's first token, then each token's under the mock's certain model: 0 where it is
        the token the mock would have produced after the tokens before it, else
        ``IMPOSSIBLE_LOGPROB`` (no probability); the top list holds that token alone."""
        prefix = self._prefixes[row.slot]
        start = len(prefix) - len(row.token_ids)
        entries: list[TokenLogprobs | None] = []
        for at in range(start, len(prefix)):
            if at == 0:
                entries.append(None)
                continue
            likely = self.model.next_token_at(prefix, at)
            logprob = 0.0 if prefix[at] == likely else IMPOSSIBLE_LOGPROB
            top = ((likely, 0.0),) if row.sampling.prompt_logprobs else ()
            entries.append(TokenLogprobs(prefix[at], logprob, top))
        return tuple(entries)

    def release(self, slot: int) -> None:
        with self._lock:
            self._prefixes[slot] = []
            self._marked[slot] = False
            self._in_prompt.discard(slot)

    def _check_blocks(self, row: StepRow) -> None:
        table = row.kv_blocks
        if table is None:
            raise ValueError(f"slot {row.slot}: a paged model's row needs a block table")
        ids = table.block_ids
        if ids and not (NULL_BLOCK < min(ids) and max(ids) < self._num_blocks):
            raise ValueError(f"slot {row.slot}: block table names a block outside the pool")
        if len(table.block_ids) * MOCK_KV_BLOCK_SIZE < row.position + len(row.token_ids):
            raise ValueError(f"slot {row.slot}: block table does not cover the row")

    def _read_blocks(self, row: StepRow) -> list[int]:
        """The cached prefix ``[0, row.position)`` of a paged row, from its blocks."""
        assert row.kv_blocks is not None
        prefix: list[int] = []
        for block in row.kv_blocks.block_ids[: -(-row.position // MOCK_KV_BLOCK_SIZE)]:
            start = block * MOCK_KV_BLOCK_SIZE
            prefix.extend(self._pool[start : start + MOCK_KV_BLOCK_SIZE])
        del prefix[row.position :]
        if _UNWRITTEN in prefix:
            raise ValueError(f"slot {row.slot}: cached prefix reads a position never written")
        return prefix

    def _write_blocks(self, row: StepRow) -> None:
        if row.kv_blocks is None:
            return
        table = row.kv_blocks.block_ids
        if len(row.token_ids) == 1:  # a decode row: one position
            block, offset = divmod(row.position, MOCK_KV_BLOCK_SIZE)
            self._pool[table[block] * MOCK_KV_BLOCK_SIZE + offset] = row.token_ids[0]
            return
        for position, token in enumerate(row.token_ids, start=row.position):
            block, offset = divmod(position, MOCK_KV_BLOCK_SIZE)
            self._pool[table[block] * MOCK_KV_BLOCK_SIZE + offset] = token


# The log-probability of a token the mock gives no probability: finite, as JSON needs (a
# response's body is strict JSON); vLLM writes -inf logprobs as -9999.0 too.
IMPOSSIBLE_LOGPROB = -9999.0


def _certain_draft_logprobs(row: StepRow, accepted: int) -> tuple[TokenLogprobs, ...] | None:
    """The accepted drafted tokens' logprobs (certain, as every mock token) when the row
    drafted and asked for logprobs, else None."""
    if row.sampling.logprobs is None or not row.num_draft_tokens:
        return None
    top = row.sampling.logprobs
    return tuple(
        TokenLogprobs(token, 0.0, ((token, 0.0),) if top else ())
        for token in row.draft_token_ids[:accepted]
    )


def _certain_logprobs(row: StepRow, token: int | None) -> TokenLogprobs | None:
    """The mock's logprobs: its next token is certain (log-probability 0, the only
    alternative with any probability), when the row sampled one and asked; else None."""
    if token is None or row.sampling.logprobs is None:
        return None
    return TokenLogprobs(token, 0.0, ((token, 0.0),) if row.sampling.logprobs else ())
