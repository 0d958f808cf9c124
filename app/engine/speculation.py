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
with logit bias, penalties or ``min_tokens`` (processors that read the counts of the tokens
before each position) decode normally, one token a step.

Back-off (``drafting_rows``): a verified draft costs ``k`` more token positions in the step.
While few rows decode, a CPU step is bound by reading the weights and the extra positions are
almost free; with many rows it is bound by compute and they cost as much as they earn. So only
steps with at most ``max_rows`` decoding rows draft, and drafted tokens count against the
step's token budget (``max_num_batched_tokens``) like any other.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from app.engine.kv_admission import KVAdmission
from app.engine.request import Sequence
from app.models.base import ModelCapabilities

# Provisional: steps with more decoding rows than this do not draft (see the module docstring).
DEFAULT_MAX_DRAFTING_ROWS = 4
DEFAULT_MAX_NGRAM = 4
DEFAULT_MIN_NGRAM = 2
_ITEM = array("i").itemsize


@dataclass(frozen=True, slots=True)
class NgramSpeculation:
    """The ``--speculative-ngram`` settings and the drafting they decide.

    Attributes:
        num_draft_tokens: most tokens drafted per row and step (``K``; 0: off).
        max_ngram / min_ngram: the suffix lengths tried, longest first (``1 <= min <= max``).
        max_rows: steps with more decoding rows than this draft nothing (the back-off).

    Raises:
        ValueError: a setting out of range.
    """

    num_draft_tokens: int
    max_ngram: int = DEFAULT_MAX_NGRAM
    min_ngram: int = DEFAULT_MIN_NGRAM
    max_rows: int = DEFAULT_MAX_DRAFTING_ROWS

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )

    def drafting_rows(self, num_decoding: int) -> bool:
        """Whether a step with ``num_decoding`` decoding rows drafts at all (the back-off)."""
        return num_decoding <= self.max_rows

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Whether ``seq`` may draft: unconstrained, and no processor that reads the tokens
        before each position (logit bias included, kept simple)."""
        return seq.matcher is None and not seq.request.sampling.uses_processors

    def drafts(
        self,
        decoding: list[Sequence],
        budget: int,
        capabilities: ModelCapabilities,
        kv: KVAdmission | None,
    ) -> list[tuple[int, ...]]:
        """A draft for each of ``decoding`` (the step's decoding sequences, in row order; empty
        where a row does not draft): none when off or when the step backs off, else each
        eligible row's within the step's token ``budget`` (less one token per decoding row),
        ``max_tokens_per_row``, its ``max_tokens``, the context length and, with a paged
        model, the KV blocks free for it (``kv.grow_draft`` takes them: a draft never
        preempts)."""
        if not self.num_draft_tokens or not self.drafting_rows(len(decoding)):
            return [()] * len(decoding)
        budget -= len(decoding)
        drafts = []
        for seq in decoding:
            limit = min(
                budget,
                capabilities.max_tokens_per_row - 1,
                seq.request.max_tokens - len(seq.generated) - 1,
                capabilities.context_length - seq.num_computed_tokens - 1,
            )
            draft = self.draft(seq, limit) if self.eligible(seq) else ()
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
