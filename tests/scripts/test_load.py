"""Tests of the load generator (scripts/load.py, scripts/loadgen/).

Statistics and workload are tested as pure functions. The client is tested against a scripted
fake server: a small Starlette app under a real uvicorn on 127.0.0.1, in a thread with its own
event loop, that streams tokens at known delays, counts requests in flight, and records DELETEs.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import load
import pytest
from harness.threaded_server import serve_in_thread
from harness.wait import wait_until
from loadgen import (
    Api,
    CancelMode,
    CancelPolicy,
    Chunk,
    LengthDist,
    LoadConfig,
    LoadResult,
    Outcome,
    RequestRecord,
    Slo,
    Transport,
    WorkloadConfig,
    run_load,
)
from loadgen.stats import percentile, summarize, tokens_per_second
from loadgen.workload import (
    RequestSpec,
    arrival_offsets,
    read_prompts_file,
    request_specs,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# ---------------------------------------------------------------------------------------------
# The fake server


@dataclass(slots=True)
class Script:
    """How the fake server answers; a test changes it before its run."""

    first_token_delay_s: float = 0.1
    token_delay_s: float = 0.05
    reject_status: int | None = None  # answer every POST with this error status
    error_after_tokens: int | None = None  # end streams with `event: error` after this many


@dataclass(slots=True)
class FakeServer:
    """The fake server's state; only the server thread changes it while a run is going."""

    url: str = ""
    script: Script = field(default_factory=Script)
    request_ids: list[str] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)  # streams the client left mid-way
    in_flight: set[str] = field(default_factory=set)
    max_in_flight: int = 0
    cancels: dict[str, asyncio.Event] = field(default_factory=dict)

    def reset(self) -> None:
        self.script = Script()
        self.request_ids, self.bodies, self.deleted, self.abandoned = [], [], [], []
        self.authorizations = []
        self.in_flight, self.max_in_flight, self.cancels = set(), 0, {}

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/generate", self.generate, methods=["POST"]),
                Route("/generate/{request_id}", self.delete, methods=["DELETE"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )

    async def generate(self, request: Request) -> Response:
        body, request_id = await self.admit(request)
        if self.script.reject_status is not None:
            return self.rejection(self.script.reject_status)
        if body.get("stream"):
            return event_stream(self.native_events(request_id, body))
        sent = await self.wait_for_tokens(request_id, body["max_tokens"])
        return JSONResponse(
            {
                "id": request_id,
                "text": "".join(f"t{i} " for i in range(sent)),
                "token_ids": list(range(sent)),
                "finish_reason": "length",
                "stop_reason": None,
                "usage": usage(body, sent),
                "timings": {},
            }
        )

    async def completions(self, request: Request) -> Response:
        body, request_id = await self.admit(request)
        return event_stream(self.openai_events(request_id, body))

    async def delete(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        self.deleted.append(request_id)
        cancel = self.cancels.get(request_id)
        if cancel is None:
            return self.rejection(404)
        cancel.set()
        return JSONResponse({"id": request_id, "status": "cancelled"})

    async def admit(self, request: Request) -> tuple[dict, str]:
        body = await request.json()
        request_id = request.headers["x-request-id"]
        self.bodies.append(body)
        self.authorizations.append(request.headers.get("authorization"))
        self.request_ids.append(request_id)
        self.in_flight.add(request_id)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        self.cancels[request_id] = asyncio.Event()
        return body, request_id

    def rejection(self, status: int) -> Response:
        kinds = {404: "not_found", 429: "overloaded", 503: "unavailable"}
        error = {"error": {"type": kinds.get(status, "internal"), "message": "no", "param": None}}
        return JSONResponse(error, status_code=status, headers={"Retry-After": "1"})

    async def tokens(self, request_id: str, max_tokens: int) -> AsyncIterator[int]:
        """Yield token indices at the scripted delays until max_tokens or a DELETE."""
        cancel = self.cancels[request_id]
        for index in range(max_tokens):
            delay = self.script.first_token_delay_s if index == 0 else self.script.token_delay_s
            try:
                await asyncio.wait_for(cancel.wait(), delay)
                return
            except TimeoutError:
                yield index

    async def wait_for_tokens(self, request_id: str, max_tokens: int) -> int:
        sent = 0
        async for _ in self.tokens(request_id, max_tokens):
            sent += 1
        self.in_flight.discard(request_id)
        return sent

    async def native_events(self, request_id: str, body: dict) -> AsyncIterator[str]:
        sent, finished = 0, False
        try:
            async for index in self.tokens(request_id, body["max_tokens"]):
                if index == self.script.error_after_tokens:
                    self.in_flight.discard(request_id)
                    finished = True
                    error = {"error": {"type": "internal", "message": "boom", "param": None}}
                    yield sse("error", error)
                    return
                sent += 1
                yield sse("token", {"id": request_id, "text": f"t{index} ", "token_ids": [index]})
            reason = "cancelled" if self.cancels[request_id].is_set() else "length"
            self.in_flight.discard(request_id)  # before the final event: the client may go on
            finished = True
            yield sse(
                "done",
                {
                    "id": request_id,
                    "finish_reason": reason,
                    "stop_reason": None,
                    "usage": usage(body, sent),
                    "timings": {},
                },
            )
        finally:
            self.in_flight.discard(request_id)
            if not finished:
                self.abandoned.append(request_id)

    async def openai_events(self, request_id: str, body: dict) -> AsyncIterator[str]:
        sent = 0
        async for index in self.tokens(request_id, body["max_tokens"]):
            sent += 1
            last = sent == body["max_tokens"]
            choice = {"index": 0, "text": f"t{index} ", "finish_reason": "length" if last else None}
            yield sse(None, {"id": request_id, "object": "text_completion", "choices": [choice]})
        self.in_flight.discard(request_id)
        yield sse(None, {"id": request_id, "choices": [], "usage": usage(body, sent)})
        yield "data: [DONE]\n\n"


def sse(event: str | None, data: dict) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


def usage(body: dict, sent: int) -> dict:
    return {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": sent}


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    with serve_in_thread(fake.app(), lifespan="off") as threaded:
        fake.url = threaded.url
        yield fake


@pytest.fixture
def fake(server: FakeServer) -> FakeServer:
    server.reset()
    return server


# Streams read over either transport: httpx, or aiohttp with httpx-sse parsing its bytes.
STREAM_TRANSPORTS = pytest.mark.parametrize("transport", list(Transport))


def config_for(url: str, **changes: object) -> LoadConfig:
    """A small closed-loop run: 8-word prompts, 5 output tokens; `changes` override."""
    workload = changes.pop("workload", WorkloadConfig(prompt_len=8, output_len=5))
    base: dict = {"url": url, "concurrency": 1, "num_requests": 2, "workload": workload}
    return LoadConfig(**{**base, **changes})


def run(config: LoadConfig) -> LoadResult:
    return asyncio.run(run_load(config))


# ---------------------------------------------------------------------------------------------
# Statistics


def test_percentile_interpolates_linearly_between_ranks() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1
    assert percentile([1, 2, 3, 4], 100) == 4
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([10, 20], 99) == pytest.approx(19.9)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentile_agrees_with_numpy_default() -> None:
    numpy = pytest.importorskip("numpy")
    sample = [((i * 7919) % 101) / 3 for i in range(57)]
    for q in (0, 12.5, 50, 90, 99, 100):
        assert percentile(sample, q) == pytest.approx(float(numpy.percentile(sample, q)))


def record(
    index: int, outcome: Outcome, chunk_times: list[float], end: float, **kw
) -> RequestRecord:
    spec = RequestSpec(index, f"r{index}", "p", max_tokens=10, cancel_after_tokens=None)
    chunks = tuple(Chunk(at=t, tokens=1) for t in chunk_times)
    fields = {"output_tokens": len(chunks), "prompt_tokens": 4, "streamed": True}
    return RequestRecord(
        spec=spec,
        started_at=0.0,
        finished_at=end,
        outcome=outcome,
        chunks=chunks,
        **{**fields, **kw},
    )


def test_summary_of_known_records() -> None:
    records = [
        # ttft 100 ms, gaps 50/50/50, e2e 300 ms, tpot (300-100)/(4-1) ms
        record(0, Outcome.OK, [0.1, 0.15, 0.2, 0.25], end=0.3),
        # ttft 200 ms, gaps 100/100, e2e 500 ms, tpot (500-200)/2 = 150 ms
        record(1, Outcome.OK, [0.2, 0.3, 0.4], end=0.5),
        record(2, Outcome.CANCELLED, [0.1, 0.2], end=0.25),
        record(
            3,
            Outcome.REJECTED,
            [],
            end=0.01,
            error="429 overloaded",
            status=429,
            output_tokens=0,
            prompt_tokens=None,
        ),
    ]
    summary = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=150, tpot_ms=100))

    assert summary.requests == 4
    assert summary.outcomes == {
        "ok": 2,
        "cancelled": 1,
        "rejected": 1,
        "error": 0,
        "transport_error": 0,
    }
    assert summary.errors == {"429 overloaded": 1}
    assert summary.ttft_ms.mean == pytest.approx(150)
    assert summary.ttft_ms.p50 == pytest.approx(150)
    assert summary.ttft_ms.max == pytest.approx(200)
    assert summary.itl_ms.count == 5  # pooled over ok requests only
    assert summary.itl_ms.p50 == pytest.approx(50)
    assert summary.itl_ms.mean == pytest.approx((50 * 3 + 100 * 2) / 5)
    assert summary.tpot_ms.mean == pytest.approx((200 / 3 + 150) / 2)
    assert summary.e2e_ms.p90 == pytest.approx(300 + 0.9 * 200)
    assert summary.output_tokens == 4 + 3 + 2  # ok and cancelled
    assert summary.prompt_tokens == 3 * 4
    assert summary.request_throughput == pytest.approx(1.0)  # 2 ok / 2 s
    assert summary.output_token_throughput == pytest.approx(4.5)
    assert summary.total_token_throughput == pytest.approx(10.5)
    assert summary.goodput == pytest.approx(0.5)  # only request 0 meets both SLOs
    assert summarize(records, 2.0, Slo()).goodput is None


def test_tokens_per_second_bins_chunks_by_arrival() -> None:
    records = [
        record(0, Outcome.OK, [0.1, 0.5, 1.2, 2.9], end=3.0),
        record(1, Outcome.CANCELLED, [0.7], end=0.8),
    ]
    assert tokens_per_second(records, bin_s=1.0) == [3, 1, 1]
    assert tokens_per_second(records, bin_s=0.5) == [2, 4, 2, 0, 0, 2]  # per second


# ---------------------------------------------------------------------------------------------
# Workload and arrivals


def test_workload_is_repeatable_and_lengths_follow_their_distribution() -> None:
    config = WorkloadConfig(
        prompt_len=40,
        output_len=100,
        prompt_len_dist=LengthDist.UNIFORM,
        output_len_dist=LengthDist.EXPONENTIAL,
        cancel=CancelPolicy(fraction=0.25, after_tokens=3),
        seed=7,
    )
    first = list(request_specs(config, 2000, run_tag="a"))
    again = list(request_specs(config, 2000, run_tag="a"))
    assert first == again
    assert first != list(request_specs(WorkloadConfig(seed=8), 2000, run_tag="a"))
    prompt_words = [len(spec.prompt.split()) for spec in first]
    assert min(prompt_words) == 20 and max(prompt_words) == 60
    assert statistics.mean(spec.max_tokens for spec in first) == pytest.approx(100, rel=0.1)
    cancelled = [spec for spec in first if spec.cancel_after_tokens is not None]
    assert len(cancelled) / len(first) == pytest.approx(0.25, abs=0.04)
    assert {spec.cancel_after_tokens for spec in cancelled} == {3}
    assert len({spec.request_id for spec in first}) == len(first)


def test_prompts_file_is_cycled_and_checked(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there", "max_tokens": 3}\n\n{"prompt": "second"}\n')
    config = WorkloadConfig(output_len=9, prompts_file=prompts)
    specs = list(request_specs(config, 3, run_tag="x"))
    assert [(s.prompt, s.max_tokens) for s in specs] == [
        ("hello there", 3),
        ("second", 9),
        ("hello there", 3),
    ]
    prompts.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:2"):
        read_prompts_file(prompts)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_gaps_have_rate_mean_and_gamma_shape(burstiness: float) -> None:
    offsets = arrival_offsets(rate=20.0, burstiness=burstiness, seed=1)
    times = [next(offsets) for _ in range(20001)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0.0
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    # a gamma of shape k has squared coefficient of variation 1/k
    cv2 = statistics.pvariance(gaps) / statistics.mean(gaps) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.15)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rate": 2.0}, "exactly one of --concurrency and --rate"),
        ({"num_requests": None}, "every run is bounded"),
        (
            {"api": Api.OPENAI, "workload": WorkloadConfig(cancel=CancelPolicy(fraction=0.5))},
            "needs --api native",
        ),
        ({"slo_ttft_ms": 100.0, "workload": WorkloadConfig(stream=False)}, "need --stream"),
    ],
)
def test_config_rejects_what_cannot_run(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_for("http://127.0.0.1:1", **changes)


# ---------------------------------------------------------------------------------------------
# Against the fake server


@STREAM_TRANSPORTS
def test_streaming_ttft_itl_tpot_match_the_server_pace(
    fake: FakeServer, transport: Transport
) -> None:
    result = run(config_for(fake.url, transport=transport, concurrency=2, num_requests=4))

    assert sorted(fake.request_ids) == sorted(r.spec.request_id for r in result.records)
    for rec in result.records:
        assert rec.outcome is Outcome.OK and rec.finish_reason == "length"
        assert (rec.output_tokens, rec.prompt_tokens) == (5, 8)
        assert 0.09 <= rec.ttft_s <= 0.25  # first token after 100 ms
        assert len(rec.itl_s) == 4
        assert 0.035 <= statistics.median(rec.itl_s) <= 0.12  # 50 ms apart
        assert 0.035 <= rec.tpot_s <= 0.12
        assert 0.28 <= rec.e2e_s <= 0.6
    assert result.summary.ttft_ms.p50 == pytest.approx(100, abs=60)
    assert result.summary.itl_ms.p50 == pytest.approx(50, abs=30)
    body = fake.bodies[0]
    assert body["stream"] is True and body["max_tokens"] == 5 and body["temperature"] == 0.0


def test_non_streamed_requests_take_usage_and_have_no_ttft(fake: FakeServer) -> None:
    fake.script = Script(first_token_delay_s=0.05, token_delay_s=0.02)
    result = run(
        config_for(fake.url, workload=WorkloadConfig(prompt_len=3, output_len=4, stream=False))
    )

    for rec in result.records:
        assert rec.outcome is Outcome.OK and not rec.streamed
        assert (rec.output_tokens, rec.prompt_tokens) == (4, 3)
        assert rec.ttft_s is None and rec.tpot_s is None
        assert 0.1 <= rec.e2e_s <= 0.4
    assert result.summary.ttft_ms is None and result.summary.e2e_ms.count == 2
    assert fake.bodies[0]["stream"] is False


@pytest.mark.parametrize(("status", "kind"), [(429, "overloaded"), (503, "unavailable")])
def test_overload_answers_count_as_rejected(fake: FakeServer, status: int, kind: str) -> None:
    fake.script = Script(reject_status=status)
    summary = run(config_for(fake.url, concurrency=3, num_requests=3)).summary

    assert summary.outcomes["rejected"] == 3 and summary.outcomes["ok"] == 0
    assert summary.errors == {f"{status} {kind}": 3}
    assert summary.request_throughput == 0


@STREAM_TRANSPORTS
def test_error_event_mid_stream_is_an_error_by_type(fake: FakeServer, transport: Transport) -> None:
    fake.script = Script(first_token_delay_s=0.01, token_delay_s=0.01, error_after_tokens=2)
    result = run(config_for(fake.url, transport=transport))

    assert [r.outcome for r in result.records] == [Outcome.ERROR, Outcome.ERROR]
    assert result.summary.errors == {"stream internal": 2}
    assert all(r.output_tokens == 2 for r in result.records)


@STREAM_TRANSPORTS
def test_cancel_with_delete_sends_delete_for_the_chosen_ids(
    fake: FakeServer, transport: Transport
) -> None:
    fake.script = Script(first_token_delay_s=0.02, token_delay_s=0.01)
    workload = WorkloadConfig(
        prompt_len=4, output_len=30, seed=3, cancel=CancelPolicy(fraction=0.5, after_tokens=3)
    )
    result = run(
        config_for(fake.url, transport=transport, concurrency=4, num_requests=10, workload=workload)
    )

    chosen = {r.spec.request_id for r in result.records if r.spec.cancel_after_tokens}
    assert 0 < len(chosen) < 10
    assert sorted(fake.deleted) == sorted(chosen)
    for rec in result.records:
        if rec.spec.request_id in chosen:
            assert rec.outcome is Outcome.CANCELLED and rec.finish_reason == "cancelled"
            assert 3 <= rec.output_tokens < 30
        else:
            assert rec.outcome is Outcome.OK and rec.output_tokens == 30
    assert result.summary.outcomes["cancelled"] == len(chosen)


@STREAM_TRANSPORTS
def test_cancel_with_disconnect_closes_the_stream(fake: FakeServer, transport: Transport) -> None:
    fake.script = Script(first_token_delay_s=0.02, token_delay_s=0.02)
    workload = WorkloadConfig(
        prompt_len=4,
        output_len=50,
        cancel=CancelPolicy(1.0, after_tokens=2, mode=CancelMode.DISCONNECT),
    )
    result = run(config_for(fake.url, transport=transport, workload=workload))

    assert [r.outcome for r in result.records] == [Outcome.CANCELLED] * 2
    assert [r.output_tokens for r in result.records] == [2, 2]
    assert all(r.e2e_s < 0.5 for r in result.records)
    assert fake.deleted == []
    wait_until(lambda: len(fake.abandoned) >= 2, 3, what="the server seeing both clients leave")
    assert sorted(fake.abandoned) == sorted(r.spec.request_id for r in result.records)


def test_closed_loop_keeps_at_most_concurrency_in_flight(fake: FakeServer) -> None:
    fake.script = Script(first_token_delay_s=0.02, token_delay_s=0.02)
    workload = WorkloadConfig(prompt_len=4, output_len=3)
    result = run(config_for(fake.url, concurrency=3, num_requests=12, workload=workload))

    assert result.summary.outcomes["ok"] == 12
    assert len(fake.request_ids) == 12
    assert fake.max_in_flight == 3


def test_open_loop_sends_num_requests_at_the_rate(fake: FakeServer) -> None:
    fake.script = Script(first_token_delay_s=0.01, token_delay_s=0.01)
    workload = WorkloadConfig(prompt_len=4, output_len=1)
    result = run(
        config_for(fake.url, concurrency=None, rate=100.0, num_requests=10, workload=workload)
    )

    assert len(fake.request_ids) == 10 and result.summary.outcomes["ok"] == 10
    offsets = arrival_offsets(100.0, 1.0, seed=0)
    planned = [next(offsets) for _ in range(10)]
    started = [r.started_at for r in result.records]
    assert all(start >= plan - 0.005 for start, plan in zip(started, planned, strict=True))
    assert started[-1] <= planned[-1] + 0.5  # late only by what a busy machine adds


def test_open_loop_bounded_by_duration_sends_the_arrivals_within_it(fake: FakeServer) -> None:
    fake.script = Script(first_token_delay_s=0.01, token_delay_s=0.01)
    workload = WorkloadConfig(prompt_len=4, output_len=1, seed=5)
    result = run(
        config_for(
            fake.url,
            concurrency=None,
            rate=30.0,
            num_requests=None,
            duration_s=0.8,
            workload=workload,
        )
    )

    expected = count_arrivals_before(30.0, seed=5, horizon_s=0.8)
    assert 10 <= expected <= 45  # 24 expected on average
    assert len(fake.request_ids) == result.summary.requests
    # all arrivals before 0.8 s, less any the clock passed 0.8 s before a late client sent them
    assert expected - 2 <= result.summary.requests <= expected


def count_arrivals_before(rate: float, seed: int, horizon_s: float) -> int:
    count = 0
    for offset in arrival_offsets(rate, 1.0, seed):
        if offset >= horizon_s:
            return count
        count += 1
    raise AssertionError("unreachable")


@STREAM_TRANSPORTS
def test_openai_stream_format(fake: FakeServer, transport: Transport) -> None:
    fake.script = Script(first_token_delay_s=0.05, token_delay_s=0.02)
    result = run(config_for(fake.url, transport=transport, api=Api.OPENAI, model="m", api_key="k"))

    for rec in result.records:
        assert rec.outcome is Outcome.OK and rec.finish_reason == "length"
        assert (rec.output_tokens, rec.prompt_tokens, len(rec.chunks)) == (5, 8, 5)
        assert 0.04 <= rec.ttft_s <= 0.2
    body = fake.bodies[0]
    assert body["model"] == "m" and body["stream_options"] == {"include_usage": True}
    assert fake.authorizations == ["Bearer k", "Bearer k"]


def test_a_scripts_own_specs_set_each_request_and_record_the_cancel(fake: FakeServer) -> None:
    fake.script = Script(first_token_delay_s=0.01, token_delay_s=0.01)
    specs = [
        RequestSpec(0, "mix-0", "plain one", max_tokens=3, cancel_after_tokens=None, stream=False),
        RequestSpec(1, "mix-1", "deleted", max_tokens=40, cancel_after_tokens=2),
        RequestSpec(
            2,
            "mix-2",
            "left",
            max_tokens=40,
            cancel_after_tokens=2,
            cancel_mode=CancelMode.DISCONNECT,
        ),
        RequestSpec(3, "mix-3", "full", max_tokens=4, cancel_after_tokens=None, ignore_eos=True),
    ]
    config = config_for(fake.url, concurrency=1, num_requests=None, duration_s=30.0)
    records = run_load_specs(config, specs)

    assert [r.spec.request_id for r in records] == ["mix-0", "mix-1", "mix-2", "mix-3"]
    assert [b["stream"] for b in fake.bodies] == [False, True, True, True]
    assert fake.bodies[3]["ignore_eos"] is True and fake.bodies[0]["ignore_eos"] is False
    plain, deleted, left, full = records
    assert (plain.outcome, plain.streamed, plain.output_tokens) == (Outcome.OK, False, 3)
    assert (deleted.outcome, deleted.finish_reason) == (Outcome.CANCELLED, "cancelled")
    assert deleted.cancel_confirmed is True and fake.deleted == ["mix-1"]
    assert left.outcome is Outcome.CANCELLED and left.final_events == 0
    assert left.cancel_confirmed is None  # nothing was DELETEd: the client left
    assert (full.outcome, full.output_tokens, full.final_events) == (Outcome.OK, 4, 1)
    assert all(r.server_request_id is None for r in records)  # the fake sends no id back


def run_load_specs(config: LoadConfig, specs: list[RequestSpec]) -> tuple[RequestRecord, ...]:
    return asyncio.run(run_load(config, specs=specs)).records


def test_aiohttp_transport_sends_plain_requests(fake: FakeServer) -> None:
    fake.script = Script(first_token_delay_s=0.01, token_delay_s=0.01)
    workload = WorkloadConfig(prompt_len=3, output_len=4, stream=False)
    for loop in ({"concurrency": 2}, {"concurrency": None, "rate": 200.0}):
        fake.reset()
        fake.script = Script(first_token_delay_s=0.01, token_delay_s=0.01)
        config = config_for(
            fake.url, **loop, num_requests=4, workload=workload, transport=Transport.AIOHTTP
        )
        result = run(config)
        assert [r.outcome for r in result.records] == [Outcome.OK] * 4
        assert all((r.output_tokens, r.prompt_tokens) == (4, 3) for r in result.records)
        assert sorted(fake.request_ids) == sorted(r.spec.request_id for r in result.records)


def test_refused_connection_is_a_transport_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    summary = run(config_for(f"http://127.0.0.1:{closed_port}")).summary

    assert summary.outcomes["transport_error"] == 2
    assert summary.errors == {"transport ConnectError": 2}


# ---------------------------------------------------------------------------------------------
# The command line


def cli_args(fake: FakeServer, *extra: str) -> list[str]:
    return [
        "--url",
        fake.url,
        "--concurrency",
        "2",
        "--num-requests",
        "4",
        "--prompt-len",
        "4",
        "--output-len",
        "3",
        "--slo-ttft-ms",
        "500",
        "--no-progress",
        *extra,
    ]


def test_cli_writes_json_with_the_documented_keys(
    fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script = Script(first_token_delay_s=0.02, token_delay_s=0.01)
    out = tmp_path / "results.json"
    assert load.main(cli_args(fake, "--out", str(out), "--api-key", "secret")) == 0

    document = json.loads(out.read_text())
    assert set(document) == {"schema", "started_at_unix", "config", "summary", "requests"}
    assert document["config"]["concurrency"] == 2
    assert document["config"]["api_key"] == "<redacted>"
    assert document["config"]["workload"]["cancel"]["mode"] == "delete"
    summary = document["summary"]
    assert summary["outcomes"]["ok"] == 4 and summary["goodput"] > 0
    assert set(summary["ttft_ms"]) == {"count", "mean", "p50", "p90", "p99", "max"}
    for key in (
        "duration_s",
        "request_throughput",
        "output_token_throughput",
        "total_token_throughput",
        "tpot_ms",
        "itl_ms",
        "e2e_ms",
        "errors",
    ):
        assert key in summary
    request = document["requests"][0]
    assert set(request) == {
        "index",
        "request_id",
        "max_tokens",
        "cancel_after_tokens",
        "streamed",
        "outcome",
        "error",
        "status",
        "finish_reason",
        "prompt_tokens",
        "output_tokens",
        "started_at",
        "finished_at",
        "ttft_ms",
        "tpot_ms",
        "e2e_ms",
        "chunks",
    }
    assert request["outcome"] == "ok" and len(request["chunks"]) == 3
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "goodput" in printed


def test_cli_plot_writes_a_png(fake: FakeServer, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    fake.script = Script(first_token_delay_s=0.02, token_delay_s=0.01)
    png = tmp_path / "load.png"
    assert load.main(cli_args(fake, "--plot", str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_cli_rejects_an_unbounded_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load.main(["--concurrency", "1"])
    assert exit_info.value.code == 2
    assert "every run is bounded" in capsys.readouterr().err


def test_percentiles_are_finite_for_a_single_request(fake: FakeServer) -> None:
    fake.script = Script(first_token_delay_s=0.01, token_delay_s=0.01)
    summary = run(config_for(fake.url, num_requests=1)).summary
    assert all(math.isfinite(v) for v in (summary.ttft_ms.p99, summary.e2e_ms.p50))
