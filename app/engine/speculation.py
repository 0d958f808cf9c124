"""N-gram (prompt-lookup) speculative decoding: which decoding rows draft, and what.

No draft model: the draft of a sequence is what followed, earlier in its own tokens (prompt and
generated), the longest suffix of them that occurred before (prompt lookup decoding, Saxena
2023, https://github.com/apoorvumang/prompt-lookup-decoding; vLLM's ``ngram`` proposer and
llama.cpp's ``--spec-type ngram-*`` do the same). Summaries, rewrites, extractions, code edits
and chats that quote themselves copy long runs of their input, which such a draft predicts.

The scheduler asks :class:`NgramSpeculation` for each decoding row's draft (``draft``) before
the step; the row then carries ``[last sampled token, *draft]`` with ``num_draft_tokens`` set
(:class:`app.models.base.StepRow`), the model verifies all of them in that one step
(:mod:`app.models.sampling.verification`: exact for greedy and sampled rows) and reports how
many it accepted; the scheduler appends the accepted tokens and the model's own one, and rolls
the KV blocks of the rejected positions back (``KVAdmission.rollback``).

Which rows draft (``eligible``): a row whose tokens do not change the next position's logits
in a way a single step cannot see. Constrained rows (a grammar mask per position) and rows
with penalties (which count the tokens before each position) decode normally, one token a
step, and so does a row with ``min_tokens`` until it has generated that many (the hold-back
depends on the position); logit bias, the same at every position, drafts.

Back-off (``worth_drafting``): a drafted token costs a share of the step, and that share grows
with the rows in the step: while few rows decode, a CPU step is bound by reading the weights
and extra positions are cheap; with many it is bound by compute. Measured
(``scripts/bench_speculation.py --step-cost``: SmolLM2 bfloat16, a 2-core AVX2 CPU, context 256,
4 drafted tokens a row), one drafted token costs 9% of a plain step at 1 row, 15% at 2, 20% at
4, 34% at 8, 47% at 16 and 53% at 32 (``DRAFT_TOKEN_COST``). A drafted token earns a token when
accepted, so a row drafts while its own running acceptance (``Sequence.draft_acceptance``, an
exponential average over its verified drafts, starting at 0.5) is at least the cost at the
step's number of decoding rows; a row held back creeps up by ``ACCEPTANCE_RECOVERY`` a step,
so it tries again now and then (text that starts copying its input is found again). Drafted
tokens also count against the step's token budget (``max_num_batched_tokens``) like any other.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from app.engine.kv_admission import KVAdmission
from app.engine.request import Sequence
from app.models.base import ModelCapabilities

# (decoding rows, the cost of one drafted token as a share of a plain step), measured: see the
# module docstring. Between two row counts the smaller one's cost holds.
DRAFT_TOKEN_COST = ((1, 0.09), (2, 0.15), (4, 0.20), (8, 0.34), (16, 0.47), (32, 0.53))
# Weight of the last verified draft in a sequence's running acceptance.
ACCEPTANCE_WEIGHT = 0.3
# How much a row held back by the cost gains a step, so that it drafts again now and then.
ACCEPTANCE_RECOVERY = 0.002
DEFAULT_MAX_NGRAM = 4
DEFAULT_MIN_NGRAM = 2
_ITEM = array("i").itemsize


@dataclass(frozen=True, slots=True)
class NgramSpeculation:
    """The ``--speculative-ngram`` settings and the drafting they decide.

    Attributes:
        num_draft_tokens: most tokens drafted per row and step (``K``; 0: off).
        max_ngram / min_ngram: the suffix lengths tried, longest first (``1 <= min <= max``).
        draft_token_cost: ``(rows, cost)`` pairs, rows increasing: the back-off's measured
            cost of a drafted token at that many decoding rows (see the module docstring).

    Raises:
        ValueError: a setting out of range.
    """

    num_draft_tokens: int
    max_ngram: int = DEFAULT_MAX_NGRAM
    min_ngram: int = DEFAULT_MIN_NGRAM
    draft_token_cost: tuple[tuple[int, float], ...] = DRAFT_TOKEN_COST

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )

    def cost_at(self, num_decoding: int) -> float:
        """The cost of one drafted token in a step of ``num_decoding`` decoding rows, as a
        share of the step (the table's entry for the largest row count not above it)."""
        cost = self.draft_token_cost[0][1]
        for rows, measured in self.draft_token_cost:
            if rows <= num_decoding:
                cost = measured
        return cost

    def worth_drafting(self, seq: Sequence, num_decoding: int) -> bool:
        """Whether ``seq``'s drafts earn what they cost in a step of ``num_decoding`` decoding
        rows. Side effect: a sequence held back gains ``ACCEPTANCE_RECOVERY``."""
        if seq.draft_acceptance >= self.cost_at(num_decoding):
            return True
        seq.draft_acceptance += ACCEPTANCE_RECOVERY
        return False

    @staticmethod
    def record(seq: Sequence, drafted: int, accepted: int) -> None:
        """A verified draft of ``seq``: ``accepted`` of ``drafted`` tokens kept."""
        share = accepted / drafted
        seq.draft_acceptance += ACCEPTANCE_WEIGHT * (share - seq.draft_acceptance)

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Whether ``seq`` may draft: unconstrained, no penalty, and past its ``min_tokens``
        (no processor whose effect differs between the positions of one row)."""
        sampling = seq.request.sampling
        return (
            seq.matcher is None
            and not sampling.uses_penalties
            and len(seq.generated) >= sampling.min_tokens
        )

    def drafts(
        self,
        decoding: list[Sequence],
        budget: int,
        capabilities: ModelCapabilities,
        kv: KVAdmission | None,
    ) -> list[tuple[int, ...]]:
        """A draft for each of ``decoding`` (the step's decoding sequences, in row order; empty
        where a row does not draft): none when off, else each eligible row's whose drafts are
        worth their cost (``worth_drafting``, which updates the row's estimate), within the
        step's token ``budget`` (less one token per decoding row), ``max_tokens_per_row``, its
        ``max_tokens``, the context length and, with a paged model, the KV blocks free for it
        (``kv.grow_draft`` takes them: a draft never preempts)."""
        if not self.num_draft_tokens:
            return [()] * len(decoding)
        rows = len(decoding)
        budget -= len(decoding)
        drafts = []
        for seq in decoding:
            limit = min(
                budget,
                capabilities.max_tokens_per_row - 1,
                seq.request.max_tokens - len(seq.generated) - 1,
                capabilities.context_length - seq.num_computed_tokens - 1,
            )
            wanted = self.eligible(seq) and self.worth_drafting(seq, rows)
            draft = self.draft(seq, limit) if wanted else ()
            if draft and kv is not None:
                draft = draft[: kv.grow_draft(seq, len(draft))]
            budget -= len(draft)
            drafts.append(draft)
        return drafts

    def draft(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """Up to ``min(limit, num_draft_tokens)`` tokens proposed to follow ``seq``'s tokens
        (empty when no suffix of them occurred before, or ``limit`` < 1)."""
        most = min(limit, self.num_draft_tokens)
        if most < 1:
            return ()
        return propose(seq.all_token_ids(), most, self.max_ngram, self.min_ngram)


def propose(tokens: Tokens[int], most: int, max_ngram: int, min_ngram: int) -> tuple[int, ...]:
    """Prompt lookup: for ``n`` from ``max_ngram`` down to ``min_ngram``, the last ``n``
    tokens are looked for earlier in ``tokens`` (the latest occurrence wins); the first match
    gives the (at most ``most``) tokens that followed it. Empty when none matches.

    ``tokens`` is searched as the bytes of an int32 array (``bytes.rfind``, C speed: a
    2,000-token sequence costs microseconds), a hit kept only at a token boundary.
    """
    count = len(tokens)
    if count < min_ngram + 1:
        return ()
    packed = array("i", tokens).tobytes()
    for n in range(min(max_ngram, count - 1), min_ngram - 1, -1):
        suffix = packed[(count - n) * _ITEM :]
        end = (count - 1) * _ITEM  # an occurrence must end before the last token
        while True:
            found = packed.rfind(suffix, 0, end)
            if found < 0:
                break
            if found % _ITEM == 0:
                start = found // _ITEM + n
                return tuple(tokens[start : start + most])
            end = found + len(suffix) - 1
    return ()


# Speculation off (``--speculative-ngram 0``): no row drafts.
NO_SPECULATION = NgramSpeculation(num_draft_tokens=0)
