"""Multi-turn chats over 3 replicas: the cache-aware router against nginx, in one run (the command
line is ``scripts/bench_routing.py``).

The workload: ``conversations`` chats of ``turns`` turns each, all sharing one system prompt of
about ``system_tokens`` tokens (sized with the replicas' own ``/tokenize``). Every chat runs its
turns one after the other (the next question is sent when the answer is complete), all chats at
once, each user pausing between turns (uniform in [0, 2 * ``think_s``], seeded: without
it the chats move in lock-step and nginx's round robin deals each chat the same replica every
turn by accident). A turn's prompt is the system prompt, the whole conversation so far and the
new question, rendered as text and sent to ``/v1/completions`` (streamed, ``ignore_eos``, so
every answer has ``answer_tokens`` tokens); the answer joins the conversation.

Each setup gets fresh replicas (cold caches) and sees the same workload:
  - ``router``: vllm-router, ``cache_aware`` (harness.router), with ``RouterSettings`` (its
    balance threshold lowered so that a shared system prompt does not send every new chat to
    one replica);
  - ``nginx``: docker/nginx.conf's routing for requests without an id (least_conn, which under
    this even load deals requests round robin);
  - ``nginx-sticky``: the same nginx, each request with ``X-Conversation-Id`` (hash affinity);
  - ``router-round-robin``: vllm-router's ``round_robin``, the baseline where nginx is missing;
  - ``sglang-router``: SGLang's router, ``cache_aware`` with the same thresholds (it matches
    prefixes of the request text, where vllm-router asks a replica for the token ids first).

Measured per setup: the prefix-cache hit rate from the replicas' own counters
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, summed over replicas)
and the same rate over the conversations' own tokens (every request's system-prompt blocks taken
out of hits and its system-prompt tokens out of queries: every setup finds those, so only this
part tells the routings apart), the share of the prompt tokens that the system prompt's whole
blocks are (``shared_floor``: every routing finds at least that, so 1 / the baseline's is the
most any routing's hit rate can be of the baseline's; ``bench_routing.py`` works it out),
client-side TTFT (send to the first streamed text) by turn, and throughput (completion tokens /
wall time of the whole workload). ``compare_rounds`` repeats it all with other seeds;
``median_result`` and ``ratios`` sum the rounds up.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from harness.cluster import local_cluster
from harness.metrics import Metrics
from harness.router import routed_cluster
from harness.sse import EventStream
from loadgen.stats import percentile

SETUPS = ("router", "nginx", "nginx-sticky", "router-round-robin", "sglang-router")
# The cache-aware policy's settings (why these: ``RouterSettings``).
CACHE_THRESHOLD = 0.3
BALANCE_ABS = 4
BALANCE_REL = 1.5
# The tokens of a turn around the user's question (``run_conversation``).
TURN_FRAME = "\nUser: " + "\nAssistant:"
WORDS = (
    "bread flour oven crust yeast rye dough bake shop order cake price open close weekend "
    "delivery gluten butter sugar recipe morning fresh slice loaf sourdough croissant"
).split()


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The cache-aware policy's settings (vllm-router's and SGLang's, the same flags).

    The policy, per request: when the replicas' in-flight requests differ by more than
    ``balance_abs`` and the busiest has more than ``balance_rel`` times the idlest's, the idlest
    gets it (and its prefix tree learns the prompt there); otherwise the replica whose tree
    holds the longest prefix of the prompt gets it when that prefix is more than
    ``cache_threshold`` of the prompt, else the idlest does. The trees' eviction is left at the
    router's defaults (``--eviction-interval-secs`` 120, ``--max-tree-size`` 2^25 characters a
    replica): it never runs in a run of this size, and need not, the chats a replica gets
    fitting its KV cache.

    Why these values, for chats over a shared system prompt (README, "Behind a cache-aware
    router", has the runs):
      - ``cache_threshold`` 0.3 (the default). A turn after the first finds the whole previous
        prompt on its own replica, 80% or more of its prompt here (the router's tree learns the
        prompts, not the answers), and at most the system prompt elsewhere, so any threshold
        under 0.8 keeps a chat where its history is. A first turn finds the system prompt (88%
        here) on whichever replica has it: no threshold tells it apart from a later turn, so
        first turns are spread by the balance rule alone.
      - ``balance_abs`` 4, half of the scenario's 8 slots (default 64: never, at this load, so
        every chat follows the system prompt to one replica), ``balance_rel`` 1.5 (the
        default; 3 measured the same). A replica takes new chats until it runs 5 more requests
        than the idlest, then the idlest gets them: 48 of the 120 requests on the busiest
        replica at most. 8 let one take 63 of them, 16 took 94 (TTFT 1.1 s); 2 spread them
        evenly but moved running chats off their cache as a replica's in-flight count swung
        with its users' pauses (own-token hit rate 0.45 against 0.63).
    """

    cache_threshold: float = CACHE_THRESHOLD
    balance_abs: int = BALANCE_ABS
    balance_rel: float = BALANCE_REL

    def flags(self) -> tuple[str, ...]:
        return (
            ("--cache-threshold", f"{self.cache_threshold:g}")
            + ("--balance-abs-threshold", str(self.balance_abs))
            + ("--balance-rel-threshold", f"{self.balance_rel:g}")
        )


@dataclass(frozen=True, slots=True)
class RoutingBench:
    """What every setup of the comparison uses."""

    setups: tuple[str, ...]
    server_args: tuple[str, ...]
    replicas: int = 3
    conversations: int = 24
    turns: int = 5
    system_tokens: int = 500
    question_words: int = 8
    answer_tokens: int = 64
    think_s: float = 1.0
    seed: int = 0
    router: RouterSettings = RouterSettings()


@dataclass(frozen=True, slots=True)
class TurnRecord:
    conversation: int
    turn: int  # 1-based
    ttft_s: float
    total_s: float
    completion_tokens: int


@dataclass
class SetupResult:
    setup: str
    hit_rate: float
    history_hit_rate: float
    prefix_hits: float
    prefix_queries: float
    wall_s: float
    completion_tokens: int
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    turn_ttft_p50_s: dict[int, float] = field(default_factory=dict)
    turn_ttft_p95_s: dict[int, float] = field(default_factory=dict)
    requests_per_replica: list[float] = field(default_factory=list)
    errors: int = 0
    shared_floor: float = 0.0


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """The tokens every prompt starts with (the system prompt's), and those of them in full KV
    blocks (16 tokens: the mock's and the paged cache's block), the part a prefix cache can
    hold. Each replica's first request finds none of them, so the history rate is a slight
    underestimate, the same for every setup."""

    tokens: int
    block_tokens: int


@dataclass(frozen=True, slots=True)
class Entry:
    """Where one setup's requests go, and the replicas whose counters it reads."""

    url: str
    replicas: tuple[str, ...]
    sticky: bool = False


@contextmanager
def started(setup: str, bench: RoutingBench, workdir: Path) -> Iterator[Entry]:
    """Fresh replicas and the setup's front, stopped on exit.

    Raises:
        ClusterError: the router or nginx is missing, or a process did not start.
    """
    replica_ids = [f"r{i}" for i in range(bench.replicas)]
    if setup.startswith("router") or setup == "sglang-router":
        policy = "round_robin" if setup == "router-round-robin" else "cache_aware"
        flags = bench.router.flags() if policy == "cache_aware" else ()
        with routed_cluster(
            replica_ids,
            workdir,
            server_args=bench.server_args,
            policy=policy,
            router="sglang-router" if setup == "sglang-router" else "vllm-router",
            router_flags=flags,
            edge=False,
        ) as cluster:
            yield Entry(cluster.router_url, tuple(cluster.replicas.values()))
    else:
        with local_cluster(replica_ids, workdir, server_args=bench.server_args) as cluster:
            sticky = setup == "nginx-sticky"
            yield Entry(cluster.url, tuple(cluster.replicas.values()), sticky=sticky)


async def system_prompt(http: httpx.AsyncClient, replica: str, tokens: int) -> str:
    """Sentences of the bakery's instructions until ``/tokenize`` counts ``tokens`` or more."""
    rng = random.Random(1)
    text = "You are the assistant of a small bakery. "
    while True:
        count = (await http.post(replica + "/tokenize", json={"prompt": text})).json()["count"]
        if count >= tokens:
            return text
        text += " ".join(rng.choices(WORDS, k=12)).capitalize() + ". "


async def shared_prefix(http: httpx.AsyncClient, replica: str, system: str) -> SharedPrefix:
    """The tokens every prompt starts with: the common start of two prompts' token ids (a
    tokenizer may merge the system prompt's last characters with what follows)."""
    prompts = [f"{system}\nUser: {word}?\nAssistant:" for word in ("yes", "no")]
    first, second = [
        (await http.post(replica + "/tokenize", json={"prompt": prompt})).json()["tokens"]
        for prompt in prompts
    ]
    common = next(
        (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), len(first)
    )
    return SharedPrefix(tokens=common, block_tokens=common // 16 * 16)


def question(bench: RoutingBench, conversation: int, turn: int) -> str:
    """The user's text of one turn: seeded words, named after its chat (never shared)."""
    rng = random.Random(bench.seed * 100_003 + conversation * 101 + turn)
    return f"(chat {conversation}) " + " ".join(rng.choices(WORDS, k=bench.question_words)) + "?"


def own_tokens(bench: RoutingBench, seeds: Sequence[int] = (0,)) -> float:
    """A conversation's own tokens at its end for a byte-level model (the mock): its questions
    with their frame and its answers, the mean over the chats of ``seeds``' workloads."""
    total = sum(
        len((TURN_FRAME + question(replace(bench, seed=seed), c, t)).encode())
        for seed in seeds
        for c in range(bench.conversations)
        for t in range(1, bench.turns + 1)
    )
    return total / (len(seeds) * bench.conversations) + bench.turns * bench.answer_tokens


async def run_conversation(
    http: httpx.AsyncClient,
    entry: Entry,
    bench: RoutingBench,
    system: str,
    model: str,
    conversation: int,
) -> list[TurnRecord]:
    """One chat's turns, one after the other, each prompt the whole chat so far.

    Raises:
        httpx.HTTPError: a turn failed (the chat stops there).
    """
    history = system
    headers = {"X-Conversation-Id": f"chat-{conversation}"} if entry.sticky else {}
    pauses = random.Random(bench.seed * 7919 + conversation)
    records = []
    for turn in range(1, bench.turns + 1):
        await asyncio.sleep(pauses.uniform(0, 2 * bench.think_s))  # the user reads and types
        history += f"\nUser: {question(bench, conversation, turn)}\nAssistant:"
        body = {"model": model, "prompt": history, "max_tokens": bench.answer_tokens}
        body |= {"stream": True, "ignore_eos": True, "temperature": 0}
        answer, record = await stream_turn(http, entry.url, body, headers, conversation, turn)
        history += answer
        records.append(record)
    return records


async def stream_turn(
    http: httpx.AsyncClient,
    url: str,
    body: dict,
    headers: dict[str, str],
    conversation: int,
    turn: int,
) -> tuple[str, TurnRecord]:
    """One streamed completion: its text, and its TTFT (send to the first text) and duration.

    Raises:
        httpx.HTTPStatusError: the answer was not a 200.
    """
    pieces: list[str] = []
    first_at = None
    sent_at = time.perf_counter()
    async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as reply:
        reply.raise_for_status()
        async for event in EventStream(reply):
            if not event.data.startswith("{"):
                continue
            text = event.json()["choices"][0]["text"]
            if text and first_at is None:
                first_at = time.perf_counter()
            pieces.append(text)
    done_at = time.perf_counter()
    ttft = (first_at or done_at) - sent_at
    record = TurnRecord(conversation, turn, ttft, done_at - sent_at, body["max_tokens"])
    return "".join(pieces), record


async def measure(setup: str, entry: Entry, bench: RoutingBench) -> SetupResult:
    """Every chat at once through ``entry``, the replicas' counters read before and after; a
    chat that failed counts as an error (its completed turns are kept)."""
    limits = httpx.Limits(max_connections=bench.conversations * 2)
    async with httpx.AsyncClient(timeout=300.0, trust_env=False, limits=limits) as http:
        model = (await http.get(entry.replicas[0] + "/v1/models")).json()["data"][0]["id"]
        system = await system_prompt(http, entry.replicas[0], bench.system_tokens)
        shared = await shared_prefix(http, entry.replicas[0], system)
        before = [await scrape(http, url) for url in entry.replicas]
        started_at = time.perf_counter()
        chats = [
            run_conversation(http, entry, bench, system, model, conversation)
            for conversation in range(bench.conversations)
        ]
        outcomes = await asyncio.gather(*chats, return_exceptions=True)
        wall_s = time.perf_counter() - started_at
        after = [await scrape(http, url) for url in entry.replicas]
    records = [r for outcome in outcomes if isinstance(outcome, list) for r in outcome]
    errors = sum(isinstance(outcome, BaseException) for outcome in outcomes)
    return summarize(setup, bench, records, errors, wall_s, before, after, shared)


async def scrape(http: httpx.AsyncClient, url: str) -> Metrics:
    """One replica's ``/metrics``."""
    return Metrics.parse((await http.get(url + "/metrics")).text)


def summarize(
    setup: str,
    bench: RoutingBench,
    records: Sequence[TurnRecord],
    errors: int,
    wall_s: float,
    before: Sequence[Metrics],
    after: Sequence[Metrics],
    shared: SharedPrefix,
) -> SetupResult:
    """One setup's numbers from its turns and the replicas' counters before and after."""

    def counted(name: str) -> float:
        return sum(a.value(name) - b.value(name) for a, b in zip(after, before, strict=True))

    hits, queries = (
        counted("vllm:prefix_cache_hits_total"),
        counted("vllm:prefix_cache_queries_total"),
    )
    own_hits = hits - len(records) * shared.block_tokens
    own_queries = queries - len(records) * shared.tokens
    tokens = sum(r.completion_tokens for r in records)
    ttfts = [r.ttft_s for r in records]
    by_turn = {t: [r.ttft_s for r in records if r.turn == t] for t in range(1, bench.turns + 1)}
    return SetupResult(
        setup=setup,
        hit_rate=round(hits / queries, 4) if queries else 0.0,
        history_hit_rate=round(own_hits / own_queries, 4) if own_queries > 0 else 0.0,
        prefix_hits=hits,
        prefix_queries=queries,
        wall_s=round(wall_s, 3),
        completion_tokens=tokens,
        tokens_per_s=round(tokens / wall_s, 1),
        ttft_p50_s=round(percentile(ttfts, 50), 4) if ttfts else float("nan"),
        ttft_p95_s=round(percentile(ttfts, 95), 4) if ttfts else float("nan"),
        turn_ttft_p50_s={t: round(percentile(v, 50), 4) for t, v in by_turn.items() if v},
        turn_ttft_p95_s={t: round(percentile(v, 95), 4) for t, v in by_turn.items() if v},
        requests_per_replica=[
            a.value("vllm:e2e_request_latency_seconds_count")
            - b.value("vllm:e2e_request_latency_seconds_count")
            for a, b in zip(after, before, strict=True)
        ],
        errors=errors,
        shared_floor=round(len(records) * shared.block_tokens / queries, 4) if queries else 0.0,
    )


def compare(bench: RoutingBench, workdir: Path) -> list[SetupResult]:
    """Every setup of ``bench.setups`` in turn, each on fresh replicas."""
    results = []
    for setup in bench.setups:
        with started(setup, bench, workdir / setup) as entry:
            results.append(asyncio.run(measure(setup, entry, bench)))
    return results


def compare_rounds(bench: RoutingBench, workdir: Path, rounds: int) -> list[list[SetupResult]]:
    """``rounds`` runs of ``compare``, round ``i`` with seed ``bench.seed + i`` (other questions
    and pauses; within a round every setup sees the same workload)."""
    return [
        compare(replace(bench, seed=bench.seed + i), workdir / f"round-{i}") for i in range(rounds)
    ]


def _median(values: Sequence[float]) -> float:
    return round(percentile(values, 50), 4) if values else float("nan")


def median_result(results: Sequence[SetupResult]) -> SetupResult:
    """One setup over several rounds: the median of every number (of each turn's TTFT, of
    each rank of the per-replica counts, busiest first), errors summed."""
    by_turn = [sorted(r.turn_ttft_p50_s) for r in results]
    turns = sorted(set(by_turn[0]).intersection(*by_turn))
    counts = [sorted(r.requests_per_replica, reverse=True) for r in results]

    def middle(name: str) -> float:
        return _median([getattr(r, name) for r in results])

    return SetupResult(
        setup=results[0].setup,
        hit_rate=middle("hit_rate"),
        history_hit_rate=middle("history_hit_rate"),
        prefix_hits=middle("prefix_hits"),
        prefix_queries=middle("prefix_queries"),
        wall_s=middle("wall_s"),
        completion_tokens=int(middle("completion_tokens")),
        tokens_per_s=middle("tokens_per_s"),
        ttft_p50_s=middle("ttft_p50_s"),
        ttft_p95_s=middle("ttft_p95_s"),
        turn_ttft_p50_s={t: _median([r.turn_ttft_p50_s[t] for r in results]) for t in turns},
        turn_ttft_p95_s={t: _median([r.turn_ttft_p95_s[t] for r in results]) for t in turns},
        requests_per_replica=[_median(rank) for rank in zip(*counts, strict=False)],
        errors=sum(r.errors for r in results),
        shared_floor=middle("shared_floor"),
    )


@dataclass(frozen=True, slots=True)
class Ratios:
    """``setup`` against ``baseline``: each round's ratio of a number, then their median.

    Attributes:
        hit_rate: over all prompt tokens (the issue's "hit rate").
        history_hit_rate: over the conversation's own tokens (beyond the shared prefix).
        hit_rate_bound: the most ``hit_rate`` can be for any routing: 1 / the baseline's
            ``shared_floor`` (a routing finds at most every prompt token; the baseline finds at
            least the shared system prompt, cached on every replica).
        turn_ttft_p50, turn_ttft_p95: the last turn's TTFT percentiles (lower is better).
        tokens_per_s: throughput.
        per_round: every round's ratios, by name.
    """

    setup: str
    baseline: str
    hit_rate: float
    history_hit_rate: float
    hit_rate_bound: float
    turn_ttft_p50: float
    turn_ttft_p95: float
    tokens_per_s: float
    per_round: dict[str, list[float]]


def ratios(rounds: Sequence[Sequence[SetupResult]], setup: str, baseline: str, turn: int) -> Ratios:
    """How ``setup`` compares with ``baseline`` over ``rounds`` (both must be in every round)."""

    def ratio(a: float, b: float) -> float:
        return round(a / b, 4) if b else float("nan")

    per_round: dict[str, list[float]] = {
        name: []
        for name in (
            "hit_rate",
            "history_hit_rate",
            "hit_rate_bound",
            "turn_ttft_p50",
            "turn_ttft_p95",
            "tokens_per_s",
        )
    }
    for results in rounds:
        ours, theirs = (next(r for r in results if r.setup == name) for name in (setup, baseline))
        per_round["hit_rate"].append(ratio(ours.hit_rate, theirs.hit_rate))
        per_round["history_hit_rate"].append(ratio(ours.history_hit_rate, theirs.history_hit_rate))
        per_round["hit_rate_bound"].append(ratio(1.0, theirs.shared_floor))
        per_round["turn_ttft_p50"].append(
            ratio(ours.turn_ttft_p50_s[turn], theirs.turn_ttft_p50_s[turn])
        )
        per_round["turn_ttft_p95"].append(
            ratio(ours.turn_ttft_p95_s[turn], theirs.turn_ttft_p95_s[turn])
        )
        per_round["tokens_per_s"].append(ratio(ours.tokens_per_s, theirs.tokens_per_s))
    middle = {name: _median(values) for name, values in per_round.items()}
    return Ratios(setup=setup, baseline=baseline, per_round=per_round, **middle)


def print_ratios(found: Ratios, turn: int) -> None:
    """``found`` in words, each median beside its rounds'."""

    def rounds(name: str) -> str:
        return ", ".join(f"{v:.2f}" for v in found.per_round[name])

    print(f"{found.setup} / {found.baseline}, median of {len(found.per_round['hit_rate'])} rounds:")
    print(
        f"  hit rate, all prompt tokens: {found.hit_rate:.2f}x ({rounds('hit_rate')}); "
        f"bound {found.hit_rate_bound:.2f}x ({rounds('hit_rate_bound')})"
    )
    print(
        f"  hit rate, the conversation's own tokens: {found.history_hit_rate:.2f}x "
        f"({rounds('history_hit_rate')})"
    )
    print(
        f"  turn {turn} TTFT p50 {found.turn_ttft_p50:.2f}x ({rounds('turn_ttft_p50')}), "
        f"p95 {found.turn_ttft_p95:.2f}x ({rounds('turn_ttft_p95')})"
    )
    print(f"  throughput {found.tokens_per_s:.2f}x ({rounds('tokens_per_s')})")


def print_table(results: Sequence[SetupResult], turns: int) -> None:
    """The comparison as a text table, turn ``turns``'s TTFT beside the overall one."""
    header = (
        f"{'setup':<20}{'hit rate':>9}{'history':>9}{'TTFT p50':>10}{'p95':>8}"
        f"{f'turn {turns} p50':>12}{'p95':>8}{'tok/s':>8}{'errors':>8}  requests per replica"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.setup:<20}{r.hit_rate:>9.3f}{r.history_hit_rate:>9.3f}{r.ttft_p50_s:>10.3f}{r.ttft_p95_s:>8.3f}"
            f"{r.turn_ttft_p50_s.get(turns, float('nan')):>12.3f}"
            f"{r.turn_ttft_p95_s.get(turns, float('nan')):>8.3f}{r.tokens_per_s:>8.1f}"
            f"{r.errors:>8}  {[int(n) for n in r.requests_per_replica]}"
        )
