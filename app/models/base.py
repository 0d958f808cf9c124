"""The contract between the scheduler and a model it can step.

The scheduler owns *which* sequences run and in which slot; the model owns everything that lives
on the device for a slot (its KV cache, its random generator) and how one step is computed.

One step takes a :class:`StepBatch`: one :class:`StepRow` per running sequence, each carrying the
tokens that are new to the model for that slot (the whole prompt, a chunk of it, or the one token
sampled last step) and the position of the first of them. The model appends those tokens to the
slot's state and, for rows with ``sample=True``, samples one next token. A model never reads state
of a slot beyond ``row.position``: whatever a previous occupant of the slot left there is stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is picked, fixed for the lifetime of one request.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: seeds the request's own random generator, so its tokens do not depend on what
            else is in the batch. The engine always fills it (a random one when the client
            sent none).
        batch_invariant: the client chose the seed, so API.md promises the same tokens
            whatever else is in the batch: a model whose kernels round a row differently with
            the batch's shape must compute this request's rows the slower, exact way.
        min_p: drop tokens whose probability (after temperature) is below ``min_p`` times the
            most likely token's; 0 disables it.
        presence_penalty / frequency_penalty: OpenAI's, over the generated tokens: a token
            generated ``c > 0`` times has ``c * frequency_penalty + presence_penalty``
            subtracted from its logit; 0 disables each.
        repetition_penalty: Hugging Face's (CTRL, https://arxiv.org/abs/1909.05858) over the
            prompt and the generated tokens: such a token's logit is divided by it when
            positive, multiplied when negative; 1 disables it.
        min_tokens: until this many tokens are generated, the model's EOS ids and
            ``min_tokens_token_ids`` cannot be sampled.
        min_tokens_token_ids: the request's stop token ids, which ``min_tokens`` holds back
            too.
        logit_bias: ``(token_id, bias)`` pairs added to the logits (distinct ids).
        logprobs: report the sampled token's raw log-probability and this many most likely
            alternatives (0..20); None: no logprobs.
        prompt_logprobs: the same for every prompt token but the first (computed during
            prefill, chunk by chunk); None: none.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    batch_invariant: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_tokens_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether any penalty needs the sequence's token counts."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def uses_processors(self) -> bool:
        """Whether any step before the temperature (bias, penalties, min_tokens) is on."""
        return bool(self.logit_bias) or self.uses_penalties or self.min_tokens > 0


# An inert row samples nothing; it still carries parameters, so every row has the same fields.
_INERT_SAMPLING = SamplingParams(temperature=0.0)


@dataclass(frozen=True, slots=True)
class ModelCapabilities:
    """What a model declares about itself, read once at start-up (rule R13).

    Attributes:
        name: human-readable model name (``/info``).
        backend: implementation, e.g. ``"mock"`` or ``"torch-cpu"``.
        context_length: most tokens (prompt + generated) one sequence may hold.
        max_num_seqs: number of batch slots the model has state for.
        vocab_size: token ids are in ``[0, vocab_size)``.
        eos_token_ids: ids that end generation unless the request ignores EOS.
        keeps_kv_cache: True when the model keeps per-slot state between steps (a KV cache);
            False for a stateless model that re-reads every prefix.
        max_tokens_per_row: most new tokens one row may carry in a step (prefill chunk size);
            a prompt longer than this is fed over several steps.
        fixed_batch_shape: True when every step must have exactly ``max_num_seqs`` rows (as a
            backend replaying a CUDA graph or a compiled program captured for one shape needs).
            The scheduler then pads each step with inert rows (``StepRow.padding``); False: a
            step has one row per scheduled sequence only.
        kv_block_size: positions per KV block of a paged KV cache; 0 for a model without one
            (its state is per slot, and rows carry no ``kv_blocks``).
        num_kv_blocks: blocks in the model's KV pool, block 0 included (the null block, never
            handed out: it pads block tables); 0 when not paged.
        weight_kernels: what computes the projections when that is chosen per CPU (the
            GGUF-block kernels: instruction set, why, types), "" otherwise (``/info``).
        verifies_drafts: the model verifies speculative rows (``StepRow.num_draft_tokens``);
            the scheduler drafts for no other model.
    """

    name: str
    backend: str
    context_length: int
    max_num_seqs: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    keeps_kv_cache: bool
    max_tokens_per_row: int
    fixed_batch_shape: bool = False
    kv_block_size: int = 0
    num_kv_blocks: int = 0
    weight_kernels: str = ""
    verifies_drafts: bool = False

    @property
    def paged(self) -> bool:
        """True when the model keeps its KV in blocks the scheduler assigns (``KVBlocks``)."""
        return self.kv_block_size > 0

    @property
    def default_max_num_batched_tokens(self) -> int:
        """The step's token budget when ``--max-num-batched-tokens`` is unset: one prompt
        chunk, or one token a slot if there are more slots."""
        return max(self.max_num_seqs, self.max_tokens_per_row)


# Block 0 of a paged pool is never allocated: block tables are padded with it, so a padded entry
# always names memory that holds finite values (zeros or keys written by no-one) and is masked.
NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class KVBlocks:
    """Where one row's sequence lives in a paged KV cache (the block table, rule R05).

    The scheduler's block manager (:class:`app.engine.kv_blocks.BlockManager`) decides it; the
    model only writes and reads through it.

    Attributes:
        block_ids: the physical block of each ``kv_block_size`` positions of the sequence,
            covering at least ``[0, position + len(token_ids))``: position ``p`` lives in block
            ``block_ids[p // kv_block_size]`` at offset ``p % kv_block_size``.
        starts_sequence: this row is the sequence's first in its slot. Positions
            ``[0, position)`` are then a cached prefix already in ``block_ids`` (none when
            ``position == 0``); the model starts the slot's per-sequence state (its random
            generator) here.
        prefix_token_ids: on a row that starts a sequence, the tokens of that cached prefix
            (``position`` of them), for per-sequence state that needs the tokens themselves
            (a sampler's history of tokens seen); empty otherwise.
        generated_token_ids: on a row that starts a sequence, the tokens it had generated
            before it was preempted and is now recomputed (empty for a new request): the
            sequence's last tokens, fed now as prompt, were sampled, one random draw each, so
            a seeded sampler advances past those draws and the penalties count them.
    """

    block_ids: tuple[int, ...]
    starts_sequence: bool = False
    prefix_token_ids: tuple[int, ...] = ()
    generated_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepRow:
    """One slot's work in one model step.

    Attributes:
        slot: batch slot in ``[0, max_num_seqs)``.
        token_ids: tokens new to the model for this slot, in order (>= 1 of them; none in an
            inert row).
        position: position of ``token_ids[0]`` in the sequence; the model's state for this
            slot covers exactly positions ``[0, position)`` before the step and
            ``[0, position + len(token_ids))`` after it. ``position == 0`` starts a new sequence.
        sample: whether a next token is wanted (False for a prompt chunk that is not the last).
        sampling: the request's sampling parameters.
        inert: a padding row (see ``padding``): it only fills a fixed batch shape. A model
            checks this first: it must not read or write the slot's state (KV cache, random
            generator, prefix) for it, and its output is ignored.
        token_mask: the constraint's allowed tokens for this row's next token (structured
            output), or None for an unconstrained row: an int32 tensor of
            ``ceil(vocab / 32)`` words in llguidance's bitmask layout (see
            :mod:`app.models.sampling.token_mask`). Only read when ``sample`` is True.
        kv_blocks: the row's block table, for a paged model (``ModelCapabilities.paged``);
            None otherwise and in inert rows.
        num_draft_tokens: speculative decoding: the last ``num_draft_tokens`` of
            ``token_ids`` are a draft to verify (``sample`` is then True). The model samples
            at each of the row's last ``num_draft_tokens + 1`` positions in order, one random
            draw per position, and stops at the first sample that differs from the drafted
            token after it; it keeps ``[0, position + 1 + accepted)`` of the row (the rest is
            rolled back) and reports ``RowOutput.num_accepted``. 0: an ordinary row.
    """

    slot: int
    token_ids: tuple[int, ...]
    position: int
    sample: bool
    sampling: SamplingParams
    inert: bool = False
    token_mask: torch.Tensor | None = field(default=None, compare=False)
    kv_blocks: KVBlocks | None = None
    num_draft_tokens: int = 0

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        """The drafted tokens this row verifies (empty for an ordinary row)."""
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]

    @property
    def starts_sequence(self) -> bool:
        """The first row of a sequence in its slot: position 0, or a cached prefix before it."""
        if self.kv_blocks is not None:
            return self.kv_blocks.starts_sequence
        return self.position == 0

    @classmethod
    def padding(cls, slot: int) -> StepRow:
        """The inert row for ``slot``: no tokens, position 0, no sampling, ``inert=True``.

        The scheduler pads a step of a fixed-shape model with one for every slot that has no
        row in it (a free slot, or a busy one whose prompt chunk did not fit the token budget),
        so a padded step holds each slot exactly once. A backend that needs a token per row
        feeds its own pad token and skips the slot's KV write for it (vLLM marks such rows
        with a padding slot id; here the flag says it).
        """
        return cls(slot, (), 0, False, _INERT_SAMPLING, inert=True)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """All rows of one model step; at most one row per slot.

    A model that does not need a fixed shape and is handed inert rows anyway treats them as
    inert in two lines, whatever its implementation::

        if batch.has_inert_rows:
            return batch.expand(self.step(batch.compacted()))
    """

    rows: tuple[StepRow, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.rows)

    @property
    def has_inert_rows(self) -> bool:
        return any(row.inert for row in self.rows)

    def compacted(self) -> StepBatch:
        """This batch without its inert rows."""
        return StepBatch(tuple(row for row in self.rows if not row.inert))

    def expand(self, output: StepOutput) -> StepOutput:
        """Aligns ``output`` of ``compacted()`` with these rows: an empty ``RowOutput`` (no
        token, no error) for every inert row.

        Raises:
            ValueError: ``output`` does not have one result per live row.
        """
        live = iter(output.rows)
        num_live = sum(not row.inert for row in self.rows)
        if len(output.rows) != num_live:
            raise ValueError(f"{len(output.rows)} results for {num_live} live rows")
        return StepOutput(tuple(_INERT_OUTPUT if row.inert else next(live) for row in self.rows))


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Raw log-probabilities at one position: float32 log-softmax of the model's logits,
    before any logits processing (API.md).

    Attributes:
        token_id: the token at this position (the sampled one, or the prompt's).
        logprob: its log-probability (natural log, <= 0).
        top: the most likely tokens as ``(token_id, logprob)``, most likely first; as many
            as asked.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RowOutput(NamedTuple):
    """What one row of a step produced (immutable; a named tuple, cheap to build per row).

    Attributes:
        token_id: the sampled token, or None when the row did not ask for one
            (``sample=False``), is inert, or failed.
        error: a client-safe message when this row failed (its token is ignored and the
            request ends with an error); None for a row that succeeded. A model that cannot
            tell which rows failed raises from ``step`` instead, failing every row.
        logprobs: the sampled token's :class:`TokenLogprobs` when the row's sampling asked
            for them (``SamplingParams.logprobs``), else None.
        prompt_logprobs: for a prompt chunk of a request with ``prompt_logprobs``, one entry
            per token of the chunk (None for the prompt's first token), else None.
        num_accepted: speculative decoding (a row with ``num_draft_tokens``): how many of its
            drafted tokens were accepted; the row's output is then
            ``draft_token_ids[:num_accepted]`` followed by ``token_id``. 0 for other rows.
        draft_logprobs: the logprobs of those accepted drafted tokens, when the row asked for
            logprobs (``logprobs`` stays the last token's), else None.
    """

    token_id: int | None = None
    error: str | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    num_accepted: int = 0
    draft_logprobs: tuple[TokenLogprobs, ...] | None = None


_INERT_OUTPUT = RowOutput()


@dataclass(frozen=True, slots=True)
class StepOutput:
    """The result of one step: ``rows[i]`` is what ``StepBatch.rows[i]`` produced.

    Attributes:
        rows: one :class:`RowOutput` per row of the step, in the batch's order.
    """

    rows: tuple[RowOutput, ...]

    @classmethod
    def of_token_ids(cls, token_ids: Sequence[int | None]) -> StepOutput:
        """An output of sampled tokens only (None: the row sampled nothing), row by row."""
        return cls(tuple(RowOutput(token) for token in token_ids))

    @property
    def next_token_ids(self) -> tuple[int | None, ...]:
        """Each row's sampled token (None where it sampled none), in row order: a view
        derived from ``rows``."""
        return tuple(row.token_id for row in self.rows)


class Tokenizer(Protocol):
    """Turns text into token ids and token ids back into bytes.

    ``decode_bytes`` returns raw UTF-8 bytes so that a character split over several tokens can
    be reassembled by the caller (see ``app.engine.detokenizer``).
    """

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes: ...


@runtime_checkable
class Model(Protocol):
    """A model the scheduler can step. Implementations: ``MockModelRunner``, ``ModelRunner``.

    ``step`` runs in a worker thread, never concurrently with itself or with ``release``.

    Raises (from ``step``): any exception means the step failed for every row in it; the
    engine fails those requests and goes on.
    """

    capabilities: ModelCapabilities
    tokenizer: Tokenizer

    def step(self, batch: StepBatch) -> StepOutput: ...

    def release(self, slot: int) -> None:
        """Forget the slot's state; the next row for it will have ``position == 0``."""
        ...
