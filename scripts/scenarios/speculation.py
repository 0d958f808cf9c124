"""N-gram speculative decoding (``--speculative-ngram``, issue 32), side by side with it off.

Two parts, on one loaded model (the engine of ``python -m app batch`` and the Python API,
without HTTP, so the figure is the step's and the scheduler's, not the edge's):

* **workloads**: the same prompts generated greedily with speculation off, then on, at
  several stream counts; tok/s of each, their ratio, the acceptance rate, and whether every
  output is the same token for token. *Input-grounded* prompts (rewrite a passage, extract
  fields from it, edit a code snippet, a chat that quotes itself) are where drafting pays;
  *free-form* stories are where it must not cost.
* **step cost** (``step_cost``): one model step of ``R`` decode rows of one token against the
  same rows each verifying ``K`` drafted tokens, at a given context: where the extra positions
  stop being almost free is where drafting should back off (``NgramSpeculation.max_rows``).

Command line: ``scripts/bench_speculation.py``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from app.llm import LLM, SamplingOptions
from app.models.base import KVBlocks, SamplingParams, StepBatch, StepOutput, StepRow
from app.models.forward.kv_cache import blocks_for
from app.models.runner import ModelRunner

PASSAGE = (
    "The harbour town of Merrow sits where the river Tane meets the sea. Its market opens at "
    "six every morning, and the fishing fleet, eleven boats in all, lands its catch by eight. "
    "In 1894 a storm destroyed the old stone pier; the town rebuilt it in timber two years "
    "later, and the timber pier still stands. The lighthouse on Gull Point was automated in "
    "1971, and its last keeper, Agnes Whitlow, ran the tea room beside it until 1990. Today "
    "the town has about 4,200 residents, a primary school with 310 pupils, a lifeboat station "
    "and a small museum of shipwrecks that is open from April to October. "
)
CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal += item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)
GROUNDED = (
    f"{PASSAGE * 3}\nRewrite the passage above in plain words, keeping every fact.\n\n"
    f"Rewritten passage:\nThe harbour town of Merrow",
    f"{PASSAGE * 2}\nExtract the facts as 'field: value' lines.\n\nTown: Merrow\nRiver:",
    f"{CODE}\n# The same function, renamed to order_total, with a docstring:\n"
    f"def order_total(items, tax_rate):\n",
    "User: Which fleet lands by eight? Quote the passage.\n"
    f"Assistant: The passage says: {PASSAGE}\nUser: Quote it again, exactly.\n"
    "Assistant: The passage says:",
)
FREE_FORM = (
    "Once upon a time, in a kingdom at the edge of the sea,",
    "The robot woke up in an empty laboratory and",
    "It was the last day of summer when the letter arrived.",
    "Write a short story about a dragon who is afraid of fire.",
)


@dataclass(frozen=True, slots=True)
class SideBySide:
    """One workload at one stream count, speculation off and on.

    Attributes:
        workload: ``grounded`` or ``free-form``.
        streams: requests generated together (the slots they fill).
        off_tok_s / on_tok_s: decode tokens per second (see ``side_by_side``).
        acceptance: accepted / drafted tokens with speculation on (None: nothing drafted).
        identical: every request's tokens the same both ways.
    """

    workload: str
    streams: int
    off_tok_s: float
    on_tok_s: float
    acceptance: float | None
    identical: bool

    @property
    def speedup(self) -> float:
        return self.on_tok_s / self.off_tok_s


def side_by_side(
    runner: ModelRunner, workload: str, streams: int, k: int, max_tokens: int
) -> SideBySide:
    """The workload's prompts (cycled to ``streams`` requests) off, then with ``k``: decode
    tok/s (the tokens after each request's first, over the run's wall time less its steps
    with prompt chunks: the prefill is the same both ways; the scheduler's drafting is
    counted), after a short warm-up run."""
    prompts = GROUNDED if workload == "grounded" else FREE_FORM
    batch = [prompts[i % len(prompts)] for i in range(streams)]
    options = SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    slots = runner.capabilities.max_num_seqs
    results = {}
    for setting in (0, k):
        model = TimedSteps(runner)
        llm = LLM(model, max_num_seqs=slots, speculative_ngram=setting)
        llm.generate(batch, SamplingOptions(max_tokens=4, temperature=0, ignore_eos=True))
        model.reset()
        started = time.perf_counter()
        generations = llm.generate(batch, options)
        decode_seconds = time.perf_counter() - started - model.prefill_seconds
        tokens = [g.token_ids for g in generations]
        decoded = sum(len(t) - 1 for t in tokens)
        results[setting] = (tokens, decoded / decode_seconds, model.acceptance)
    (off, off_tok_s, _), (on, on_tok_s, acceptance) = results[0], results[k]
    return SideBySide(workload, streams, off_tok_s, on_tok_s, acceptance, off == on)


class TimedSteps:
    """A runner (``Model``) that times its steps with prompt chunks and counts drafted and
    accepted tokens."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.capabilities = runner.capabilities
        self.tokenizer = runner.tokenizer
        self.reset()

    def reset(self) -> None:
        self.prefill_seconds = 0.0
        self.drafted = 0
        self.accepted = 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def step(self, batch: StepBatch) -> StepOutput:
        started = time.perf_counter()
        output = self.runner.step(batch)
        if any(len(row.token_ids) != 1 + row.num_draft_tokens for row in batch.rows):
            self.prefill_seconds += time.perf_counter() - started
        self.drafted += sum(row.num_draft_tokens for row in batch.rows)
        self.accepted += sum(output.num_accepted or ())
        return output

    def release(self, slot: int) -> None:
        self.runner.release(slot)


@dataclass(frozen=True, slots=True)
class StepCost:
    """One step of ``rows`` decode rows, plain and verifying ``k`` drafted tokens each."""

    rows: int
    k: int
    plain_ms: float
    verify_ms: float

    @property
    def ratio(self) -> float:
        return self.verify_ms / self.plain_ms


def step_cost(runner: ModelRunner, rows: int, k: int, context: int, repeats: int) -> StepCost:
    """Median wall time of a step of ``rows`` one-token rows at position ``context``, and of
    the same rows carrying ``k`` drafted tokens (greedy, every draft rejected or not: the step's
    compute is the same). The rows write into ``rows`` disjoint block tables of the pool."""
    greedy = SamplingParams(temperature=0.0)
    per_row = blocks_for(context + k + 1)
    tables = [tuple(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(rows)]

    def timed(draft: int) -> float:
        times = []
        for _ in range(repeats):
            batch = StepBatch(
                tuple(
                    StepRow(
                        slot,
                        (1,) * (draft + 1),
                        context,
                        True,
                        greedy,
                        kv_blocks=KVBlocks(tables[slot], starts_sequence=True),
                        num_draft_tokens=draft,
                    )
                    for slot in range(rows)
                )
            )
            started = time.perf_counter()
            runner.step(batch)
            times.append(time.perf_counter() - started)
            for slot in range(rows):
                runner.release(slot)
        return statistics.median(times) * 1000.0

    timed(0)  # warm the shapes
    return StepCost(rows, k, timed(0), timed(k))
