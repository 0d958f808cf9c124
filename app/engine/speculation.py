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

Back-off: a row drafts as many tokens as are worth their cost, and the cost is measured on the
running server, step by step (:class:`DraftCosts`).

*What a drafted token costs.* A decode-only step of ``R`` rows takes ``T0(R)`` seconds plain
(each row ``T0(R) / R``) and ``T0(R) + D * m`` with ``D`` drafted tokens among its rows. Its
cost ``c(R) = m / (T0(R) / R)`` is a drafted token's extra time over a plain row's share:
speculation is worth it exactly when the drafted tokens earn more than ``c`` tokens each (``R +
accepted`` tokens in ``T0 (1 + c D / R)`` beats ``R`` in ``T0``). The scheduler times every
step from ``schedule`` to the end of ``advance`` (its output applied), so the figure holds the
model's extra positions, the verification's sampling per position, the drafting and the KV
rollback, on the kernels and the cores the server has now. Decode-only steps are kept (a prompt
chunk would swamp the difference): ``T0(R)`` is the median of the last plain steps at exactly
``R`` rows (at least ``MIN_PLAIN_SAMPLES`` of them), and each step with drafts gives one sample
``c = (T / T0(R) - 1) R / D``; ``c(R)`` is the median of the last ``COST_SAMPLES`` samples at
``R``'s row class (1, 2-3, 4-7, ..., 64+). Medians, because a shared machine's steps spike. A
row count whose plain time is unknown, or ``PLAIN_EVERY`` drafted steps old, gets a plain step
(no row drafts) to measure it; until a row class has ``MIN_COST_SAMPLES`` samples,
``DRAFT_TOKEN_COST`` stands in. A cost that holds every row back gets no new sample, so it ages
instead: ``HOLD_PATIENCE`` held steps drop its oldest sample, the wait doubling each time
(``DraftCosts.drafted_at_cost``). Before that rule, two spiked samples of a fresh server's
first drafted steps (1.19 against a copying row's acceptance of 1.0) stopped drafting at one
row for the server's life.

*How many tokens a row drafts.* Each row keeps ``Sequence.draft_acceptance``: the running
probability ``q`` that a drafted token is accepted given that the ones before it were (an
exponential average over its verified positions, weight ``ACCEPTANCE_WEIGHT``, from 0.5).
The ``j``-th drafted token is accepted with probability ``q**j`` and costs ``c``, so a row
drafts ``j`` tokens for every ``j <= K`` with ``q**j >= c``: a row that copies its input
drafts the full ``K``, a row of free text one or two tokens, and none once ``q < c``. A row
held back gains ``ACCEPTANCE_RECOVERY`` a step, so it drafts one token again now and then
(text that starts copying its input is found again, and the row class's cost is sampled
again). No separate cap on a step's drafted tokens as a share of its rows: every drafted
token must earn its measured cost, and the cost's samples come from the steps' real mix of
drafts. Drafted tokens also count against the step's token budget
(``max_num_batched_tokens``) like any other.

*Measured* (``scripts/bench_speculation.py --step-cost``, SmolLM2-135M Q4_1 on the quantized
kernels, a 2-core AVX2 AMD EPYC shared with other work, context 256, 4 drafted tokens a row;
the model step only): ``c`` = 0.04 at 1 row, 0.16 at 2, 0.24 at 4, 0.37 at 8 with torch's 2
threads (0.14, 0.20 and 0.41 at 1, 4 and 16 rows with 1 thread), and at 16 and 32 rows the
shared cores' noise swamped the 2-thread figure: ``DRAFT_TOKEN_COST`` holds those and, from 16
rows on, 0.5, 0.75 and 1.0 until the server has measured. A fixed table measured on an earlier
bfloat16 path (0.09 at 1 row to 0.53 at 32) lost 13% at 16 free-form streams (0.87x): why the
server measures for itself. With this rule (``scripts/bench_speculation.py --threads 1``, 3
rounds alternating on and off, median of the rounds' ratios, greedy output identical in every
run; the machine at a load of 5-8): grounded prompts 1.62x at 1 stream (66% of drafted tokens
accepted; 1.79x with ``K`` = 8, 54%) and 1.31x at 4 (84%); free-form stories 1.10x at 1 stream
(31%), 1.06x at 16 (78%) and 1.03x at 64 (no row drafted; its rounds spread 0.87-1.12, the
noise of the shared machine); with ``MIN_PLAIN_SAMPLES``, grounded 1.69x and 1.35x, free-form
0.97x, 1.02x and 0.98x (no row drafted at 64). On the 2-core AMX Xeon with the GGUF-block
kernels (2026-12-06, every grounded prompt run alone at 1 stream, docs/MODEL_PERF.md): grounded
1.58x at 1 stream (82%) and 1.11x at 4; free-form 1.38x, 1.02x and 0.96x at 1, 16 and 64: with
the stuck cost of ``HOLD_PATIENCE``'s note (the quoting prompt drafted for its first 10 steps
only). Zen 4, ``K`` = 8, ageing: grounded 1.89x and 2.14x at 1 stream, 1.06x at 4; free-form
1.45x, 0.96-0.97x and 0.99x at 1, 16 and 64; then ``DRAFT_MARGIN``: docs/MODEL_PERF.md.
"""

from __future__ import annotations

import statistics
from array import array
from collections import deque
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from app.engine.kv_admission import KVAdmission
from app.engine.request import Sequence
from app.models.base import ModelCapabilities

# (decoding rows, the cost of a drafted token as a share of a plain row), measured: see the
# module docstring; the stand-in until the server has measured. Between two row counts the
# smaller one's cost holds.
DRAFT_TOKEN_COST = ((1, 0.04), (2, 0.16), (4, 0.24), (8, 0.37), (16, 0.5), (32, 0.75), (64, 1.0))
# A drafted token must be expected to earn this many times its measured cost (at break-even,
# free text at 16 rows, 43% accepted, lost 2-3% through the estimates' noise).
DRAFT_MARGIN = 1.5
# Weight of one verified position in a sequence's running acceptance.
ACCEPTANCE_WEIGHT = 0.2
# How much a row held back by the cost gains a step, so that it drafts again now and then.
ACCEPTANCE_RECOVERY = 0.002
DEFAULT_MAX_NGRAM = 4
DEFAULT_MIN_NGRAM = 2
# The online measurement (``DraftCosts``): plain step times kept per row count, cost samples
# per row class, the plain steps a row count needs before it is compared with (one step that
# spiked is not its plain time), the samples a class needs before its median replaces the
# table, and how many drafted steps at a row count may pass before a plain one re-measures it.
PLAIN_SAMPLES = 9
MIN_PLAIN_SAMPLES = 3
COST_SAMPLES = 15
MIN_COST_SAMPLES = 3
PLAIN_EVERY = 40
# A row class whose measured cost has held its eligible rows back (none drafted) for this many
# decode steps drops its oldest cost sample, and waits twice as long before the next drop (up
# to HOLD_PATIENCE_MAX); a step that drafts at the measured cost resets the wait.
HOLD_PATIENCE = 16
HOLD_PATIENCE_MAX = 1024
_ITEM = array("i").itemsize


def draft_length(acceptance: float, cost: float, most: int) -> int:
    """Drafted tokens worth their cost: the largest ``j <= most`` with ``acceptance**j >=
    cost`` (0 when even one is not)."""
    length = 0
    earned = acceptance
    while length < most and earned >= cost:
        length += 1
        earned *= acceptance
    return length


def table_cost(table: tuple[tuple[int, float], ...], rows: int) -> float:
    """``table``'s cost at ``rows`` decoding rows: the entry for the largest row count not
    above it (the first entry below the first row count)."""
    cost = table[0][1]
    for count, measured in table:
        if count <= rows:
            cost = measured
    return cost


class DraftCosts:
    """The cost of a drafted token at each row count, measured from the scheduler's own steps
    (the rule and its figures: the module docstring). One per scheduler.

    Args:
        table: the stand-in costs until measured (``NgramSpeculation.draft_token_cost``).
        measure: False: ``table`` always (tests; a step's wall time is never looked at).
    """

    def __init__(self, table: tuple[tuple[int, float], ...], measure: bool = True) -> None:
        self.table = table
        self.measure = measure
        self._plain: dict[int, deque[float]] = {}
        self._drafted_since_plain: dict[int, int] = {}
        self._samples: dict[int, deque[float]] = {}
        self._holds: dict[int, tuple[int, int]] = {}  # row class: (steps held, patience)
        self._timing: tuple[object, float, int, int] | None = None

    @staticmethod
    def row_class(rows: int) -> int:
        """Row counts sharing a cost estimate: 1, 2-3, 4-7, ..., 32-63, 64 and more."""
        return min(rows.bit_length(), 7)

    def cost(self, rows: int) -> float:
        """A drafted token's cost, as a share of a plain row, in a step of ``rows`` decoding
        rows: the median of the row class's samples, or the table's until there are enough."""
        samples = self._samples.get(self.row_class(rows))
        if samples is not None and len(samples) >= MIN_COST_SAMPLES:
            return statistics.median(samples)
        return table_cost(self.table, rows)

    def measured(self, rows: int) -> bool:
        """Whether ``cost(rows)`` is measured (enough samples), not the table's."""
        samples = self._samples.get(self.row_class(rows))
        return samples is not None and len(samples) >= MIN_COST_SAMPLES

    def drafted_at_cost(self, rows: int, drafted: bool) -> None:
        """A decode step of ``rows`` rows was drafted at the measured cost: ``drafted``, some
        row drafted; False, the cost held every eligible row back.

        Samples only come from drafted steps, so without this a cost that spiked (a shared
        machine's burst over the few samples a row class has) would hold every row back for
        good: once held for ``HOLD_PATIENCE`` steps the oldest sample goes (the estimate ages
        out), the wait doubling while drafting does not resume (a cost that is really that
        high is probed more and more rarely). A row class without measured samples (the
        table's cost) is left alone."""
        cls = self.row_class(rows)
        if not self.measured(rows):
            return
        if drafted:
            self._holds[cls] = (0, HOLD_PATIENCE)
            return
        held, patience = self._holds.get(cls, (0, HOLD_PATIENCE))
        held += 1
        if held >= patience:
            self._samples[cls].popleft()
            held, patience = 0, min(2 * patience, HOLD_PATIENCE_MAX)
        self._holds[cls] = (held, patience)

    def plain_due(self, rows: int) -> bool:
        """Whether the next step of ``rows`` decoding rows should be plain (no drafts), to
        measure (or re-measure) ``T0(rows)``."""
        if not self.measure:
            return False
        plain = self._plain.get(rows)
        if plain is None or len(plain) < MIN_PLAIN_SAMPLES:
            return True
        return self._drafted_since_plain[rows] >= PLAIN_EVERY

    def observe(self, rows: int, drafted: int, seconds: float) -> None:
        """A decode-only step of ``rows`` rows with ``drafted`` drafted tokens took
        ``seconds`` (from scheduling to its output applied)."""
        if not self.measure or rows < 1 or seconds <= 0.0:
            return
        if not drafted:
            self._plain.setdefault(rows, deque(maxlen=PLAIN_SAMPLES)).append(seconds)
            self._drafted_since_plain[rows] = 0
            return
        plain = self._plain.get(rows)
        if plain is None or len(plain) < MIN_PLAIN_SAMPLES:
            return
        self._drafted_since_plain[rows] += 1
        sample = max(0.0, (seconds / statistics.median(plain) - 1.0) * rows / drafted)
        samples = self._samples.setdefault(self.row_class(rows), deque(maxlen=COST_SAMPLES))
        samples.append(sample)

    def scheduled(self, step: object, started: float, rows: int, drafted: int) -> None:
        """The scheduler built ``step`` (started at ``started``): ``rows`` decoding rows with
        ``drafted`` drafted tokens and nothing else (``rows`` 0: it holds a prompt chunk, and
        is not timed)."""
        self._timing = (step, started, rows, drafted) if rows and self.measure else None

    def applied(self, step: object, now: float) -> None:
        """``step``'s output was applied at ``now``: observed when it was the step timed."""
        timing = self._timing
        if timing is not None and timing[0] is step:
            self._timing = None
            self.observe(timing[2], timing[3], now - timing[1])


@dataclass(frozen=True, slots=True)
class NgramSpeculation:
    """The ``--speculative-ngram`` settings and the drafting they decide.

    Attributes:
        num_draft_tokens: most tokens drafted per row and step (``K``; 0: off).
        max_ngram / min_ngram: the suffix lengths tried, longest first (``1 <= min <= max``).
        draft_token_cost: ``(rows, cost)`` pairs, rows increasing: a drafted token's cost at
            that many decoding rows until the server has measured it (module docstring).
        measure: measure the cost from the steps' wall times (False: the table always).

    Raises:
        ValueError: a setting out of range.
    """

    num_draft_tokens: int
    max_ngram: int = DEFAULT_MAX_NGRAM
    min_ngram: int = DEFAULT_MIN_NGRAM
    draft_token_cost: tuple[tuple[int, float], ...] = DRAFT_TOKEN_COST
    measure: bool = True

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )

    def cost_model(self) -> DraftCosts:
        """A fresh measurement of the drafted token's cost (one per scheduler)."""
        return DraftCosts(self.draft_token_cost, self.measure and self.num_draft_tokens > 0)

    def worth(self, seq: Sequence, cost: float) -> int:
        """How many tokens ``seq`` should draft when one costs ``cost`` (``draft_length`` of
        its running acceptance). Side effect: a sequence held back gains
        ``ACCEPTANCE_RECOVERY``."""
        length = draft_length(seq.draft_acceptance, cost * DRAFT_MARGIN, self.num_draft_tokens)
        if not length:
            seq.draft_acceptance = min(1.0, seq.draft_acceptance + ACCEPTANCE_RECOVERY)
        return length

    @staticmethod
    def record(seq: Sequence, drafted: int, accepted: int) -> None:
        """A verified draft of ``seq``: ``accepted`` of ``drafted`` tokens kept. Each accepted
        position pulls the running acceptance towards 1, the first rejected one towards 0
        (the positions after it were never a question)."""
        acceptance = seq.draft_acceptance
        for _ in range(accepted):
            acceptance += ACCEPTANCE_WEIGHT * (1.0 - acceptance)
        if accepted < drafted:
            acceptance -= ACCEPTANCE_WEIGHT * acceptance
        seq.draft_acceptance = acceptance

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
        costs: DraftCosts | None = None,
    ) -> list[tuple[int, ...]]:
        """A draft for each of ``decoding`` (the step's decoding sequences, in row order; empty
        where a row does not draft): none when off or when ``costs`` wants a plain step, else
        each eligible row's as long as is worth its cost (``worth``, at ``costs``' cost for
        this many rows; without ``costs``, the table's), within the step's token ``budget``
        (less one token per decoding row), ``max_tokens_per_row``, its ``max_tokens``, the
        context length and, with a paged model, the KV blocks free for it (``kv.grow_draft``
        takes them: a draft never preempts)."""
        rows = len(decoding)
        if not self.num_draft_tokens or (costs is not None and costs.plain_due(rows)):
            return [()] * rows
        cost = costs.cost(rows) if costs is not None else table_cost(self.draft_token_cost, rows)
        budget -= rows
        drafts = []
        eligible = held = 0
        for seq in decoding:
            limit = min(
                budget,
                capabilities.max_tokens_per_row - 1,
                seq.request.max_tokens - len(seq.generated) - 1,
                capabilities.context_length - seq.num_computed_tokens - 1,
            )
            length = 0
            if self.eligible(seq):
                length = self.worth(seq, cost)
                eligible += 1
                held += not length
            draft = self.draft(seq, min(limit, length)) if length else ()
            if draft and kv is not None:
                draft = draft[: kv.grow_draft(seq, len(draft))]
            budget -= len(draft)
            drafts.append(draft)
        drafted = any(drafts)
        if costs is not None and (drafted or (eligible and held == eligible)):
            costs.drafted_at_cost(rows, drafted)  # drafting, or every row held back by the cost
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

    A match whose continuation runs into the end of ``tokens`` (text repeating with period
    ``p``: the latest occurrence is ``p`` tokens back, so only ``p`` tokens follow it) goes on
    through the draft itself: the text predicted to repeat once is predicted to repeat again,
    so the draft is the last ``p`` tokens cycled up to ``most``, not cut at ``p``. (What a
    lookup over the tokens plus its own draft would propose; a model caught in a loop of a
    short line drafts the whole ``most`` instead of one line a step.)

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
                period = count - start
                return tuple(tokens[start + i % period] for i in range(most))
            end = found + len(suffix) - 1
    return ()


# Speculation off (``--speculative-ngram 0``): no row drafts.
NO_SPECULATION = NgramSpeculation(num_draft_tokens=0)
