"""N-gram speculative decoding (``--speculative-ngram``, issue 32), side by side with it off.

Three parts, on one loaded model (the engine of ``python -m app batch`` and the Python API,
without HTTP, so the figure is the step's and the scheduler's, not the edge's) and
llama.cpp's server on the same file:

* **workloads**: the same prompts generated greedily with speculation off and on, in rounds
  that alternate which goes first, at several stream counts; tok/s of each, their ratio, the
  acceptance rate, and whether every output is the same token for token. *Input-grounded*
  prompts (rewrite a passage, extract fields from it, edit a code snippet, a chat that quotes
  itself) are where drafting pays; *free-form* stories are where it must not cost.
* **step cost** (``step_cost``): one model step of ``R`` decode rows of one token against the
  same rows each verifying ``K`` drafted tokens, at a given context: where the extra positions
  stop being almost free is where drafting should back off (``DRAFT_TOKEN_COST``, the
  stand-in until a running server has measured it: ``app.engine.speculation.DraftCosts``).
* **llama.cpp** (``llama_server_side_by_side``): its server on the same GGUF file, the grounded
  prompts at 1 stream, its ``--spec-type ngram-simple`` off and on.

Command line: ``scripts/bench_speculation.py``.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

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
    """One workload at one stream count, speculation off and on, over alternating rounds.

    Attributes:
        workload: ``grounded`` or ``free-form``.
        streams: requests generated together (the slots they fill).
        off_tok_s / on_tok_s: median decode tokens per second over the rounds (see
            ``side_by_side``).
        ratios: each round's on ÷ off (the two runs of a round are back to back).
        acceptance: accepted / drafted tokens with speculation on, all rounds (None: nothing
            drafted).
        identical: every request's tokens the same both ways, every round.
    """

    workload: str
    streams: int
    off_tok_s: float
    on_tok_s: float
    ratios: tuple[float, ...]
    acceptance: float | None
    identical: bool

    @property
    def speedup(self) -> float:
        """The median of the rounds' ratios (a round's two runs share the machine's load)."""
        return statistics.median(self.ratios)


def side_by_side(
    runner: ModelRunner, workload: str, streams: int, k: int, max_tokens: int, rounds: int = 3
) -> SideBySide:
    """The workload's prompts, off and with ``k``, in ``rounds`` rounds that alternate which
    goes first: decode tok/s (the tokens after each request's first, over the runs' wall time
    less their steps with prompt chunks: the prefill is the same both ways; the scheduler's
    drafting and its measuring are counted). The prompts go ``streams`` at a time, cycled,
    until every one has run: at 1 stream each prompt alone, one after another (before
    2026-12-06 only the first one ran at 1 stream), at 4 the four together, at 16 each four
    times. Each setting gets a fresh engine per round (a server just started: its
    drafted-token cost not yet measured) after a short warm-up run."""
    prompts = GROUNDED if workload == "grounded" else FREE_FORM
    waves = -(-len(prompts) // streams)
    batches = [
        [prompts[(wave * streams + i) % len(prompts)] for i in range(streams)]
        for wave in range(waves)
    ]
    options = SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    speeds: dict[int, list[float]] = {0: [], k: []}
    outputs: dict[int, list[list[int]]] = {}
    identical = True
    drafted = accepted = 0
    for index in range(rounds):
        for setting in (0, k) if index % 2 == 0 else (k, 0):
            model = TimedSteps(runner)
            llm = LLM(
                model, max_num_seqs=runner.capabilities.max_num_seqs, speculative_ngram=setting
            )
            llm.generate(batches[0], SamplingOptions(max_tokens=4, temperature=0, ignore_eos=True))
            model.reset()
            started = time.perf_counter()
            tokens = [g.token_ids for batch in batches for g in llm.generate(batch, options)]
            decode_seconds = time.perf_counter() - started - model.prefill_seconds
            speeds[setting].append(sum(len(t) - 1 for t in tokens) / decode_seconds)
            identical &= outputs.setdefault(setting, tokens) == tokens
            drafted += model.drafted
            accepted += model.accepted
        identical &= outputs[0] == outputs[k]
    ratios = tuple(on / off for on, off in zip(speeds[k], speeds[0], strict=True))
    return SideBySide(
        workload,
        streams,
        statistics.median(speeds[0]),
        statistics.median(speeds[k]),
        ratios,
        accepted / drafted if drafted else None,
        identical,
    )


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
        self.accepted += sum(row.num_accepted for row in output.rows)
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


# ----------------------------------------------------------------------- llama.cpp's server

LLAMA_SERVER = Path("/root/.cache/llama-server/llama-server")


@dataclass(frozen=True, slots=True)
class LlamaServerSideBySide:
    """llama.cpp's server on the grounded prompts at 1 stream, its n-gram speculation off
    and on (``--spec-type``), over alternating rounds.

    Attributes:
        spec_type: the ``--spec-type`` of the run with speculation.
        off_tok_s / on_tok_s: median decode tok/s over the rounds (the server's own
            ``timings``: generated tokens over the time generating them, prompt excluded).
        ratios: each round's on ÷ off.
        acceptance: ``draft_n_accepted / draft_n`` over every run with speculation.
        identical: the same text both ways, every prompt and round.
    """

    spec_type: str
    off_tok_s: float
    on_tok_s: float
    ratios: tuple[float, ...]
    acceptance: float | None
    identical: bool

    @property
    def speedup(self) -> float:
        return statistics.median(self.ratios)


def llama_server_side_by_side(
    gguf: Path,
    k: int,
    max_tokens: int,
    rounds: int = 3,
    threads: int = 2,
    binary: Path = LLAMA_SERVER,
) -> LlamaServerSideBySide:
    """Two llama.cpp servers on ``gguf`` (one slot, ``threads`` threads), one without
    speculation and one with ``ngram-simple`` (a lookup n-gram of 3 tokens, up to ``k``
    drafted: the nearest to ``--speculative-ngram k``'s 4-to-2-token suffixes), the grounded
    prompts sent one at a time, greedy, ``max_tokens`` each, alternately to either server."""
    spec = [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
        "--spec-ngram-simple-size-m", str(k), "--spec-draft-n-max", str(k),
    ]  # fmt: skip
    servers = {False: _start_llama_server(binary, gguf, threads, []), True: None}
    try:
        servers[True] = _start_llama_server(binary, gguf, threads, spec)
        speeds: dict[bool, list[float]] = {False: [], True: []}
        texts: dict[tuple[bool, int], str] = {}
        identical = True
        drafted = accepted = 0
        for index in range(rounds):
            for speculate in (False, True) if index % 2 == 0 else (True, False):
                tokens = seconds = 0.0
                for number, prompt in enumerate(GROUNDED):
                    answer = _llama_completion(servers[speculate][1], prompt, max_tokens)
                    timings = answer["timings"]
                    tokens += timings["predicted_n"]
                    seconds += timings["predicted_ms"] / 1000.0
                    drafted += timings.get("draft_n", 0)
                    accepted += timings.get("draft_n_accepted", 0)
                    seen = texts.setdefault((speculate, number), answer["content"])
                    identical &= seen == answer["content"]
                speeds[speculate].append(tokens / seconds)
        identical &= all(texts[(True, n)] == texts[(False, n)] for n in range(len(GROUNDED)))
    finally:
        for server in servers.values():
            if server is not None:
                server[0].terminate()
                server[0].wait(timeout=30)
    return LlamaServerSideBySide(
        "ngram-simple",
        statistics.median(speeds[False]),
        statistics.median(speeds[True]),
        tuple(on / off for on, off in zip(speeds[True], speeds[False], strict=True)),
        accepted / drafted if drafted else None,
        identical,
    )


def _start_llama_server(
    binary: Path, gguf: Path, threads: int, extra: list[str]
) -> tuple[subprocess.Popen[bytes], int]:
    """A llama.cpp server on a free local port, once its ``/health`` answers ok."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-t", str(threads), "-c", "4096", "-np", "1", *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}: {command}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return process, port
        except OSError:
            pass
        time.sleep(0.2)  # polling a child process's port: nothing to wait on instead
    process.terminate()
    raise RuntimeError(f"llama-server did not answer /health in 120 s: {command}")


def _llama_completion(port: int, prompt: str, max_tokens: int) -> dict:
    """llama.cpp's ``/completion``, greedy, ``max_tokens`` tokens whatever the EOS."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply)
