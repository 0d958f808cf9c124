"""The batch runner in this process on the mock: every answer is the HTTP endpoint's own, output
lines in input order in OpenAI's shape (read back by the openai SDK's types), lines finishing out
of order, every slot busy, the window bounding what is read, a 10,000-line file in bounded
memory, and a reading failure after the lines before it."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness.wait import wait_for
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject
from rich.console import Console

from app.batch.config import BatchConfig
from app.batch.endpoints import EndpointAnswer
from app.batch.progress import BatchProgress, BatchTally
from app.batch.reader import LineReader
from app.batch.requests import BatchRequest, LineParser
from app.batch.runner import BatchFailed, BatchRunner, run_batch
from app.models.base import StepBatch, StepOutput
from app.models.mock import MockModelRunner
from tests.batch.conftest import batch_config, batch_line, chat_body, read_output, write_input
from tests.http.conftest import RecordingMock, app_client, mock_config

CHAT = "/v1/chat/completions"
MIB = 2**20


async def run(config: BatchConfig, model: MockModelRunner | None = None) -> BatchTally:
    tally = BatchTally()
    progress = BatchProgress(Console(file=io.StringIO()), tally, enabled=config.progress)
    await run_batch(config, tally, progress, model=model)
    return tally


# Bodies for both endpoints: answered, refused by the schema, by the builder, failed by the model.
CASES: list[tuple[str, dict[str, Any] | list[int]]] = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 12}),
    ("/v1/completions", {"prompt": ["Once upon"], "max_tokens": 40, "stop": "a"}),
    ("/v1/completions", {"prompt": "p", "max_tokens": 5, "ignore_eos": True, "unknown": 1}),
    ("/v1/completions", {"prompt": "p", "max_tokens": 0}),
    (CHAT, chat_body("Hi there", max_completion_tokens=9)),
    (
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "parts"}]},
            ],
            "max_tokens": 6,
        },
    ),
    ("/v1/completions", {"prompt": "p", "temperature": 5}),
    ("/v1/completions", {"max_tokens": 3}),
    ("/v1/completions", {"prompt": "p", "n": 2}),
    ("/v1/completions", {"prompt": "p", "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "p", "max_tokens": 100_000}),
    ("/v1/completions", {"prompt": "x" * 200, "max_tokens": 100}),
    ("/v1/completions", {"prompt": "x" * 1500}),
    (CHAT, {"messages": []}),
    (CHAT, chat_body("x", logprobs=True)),
    ("/v1/completions", [1, 2]),
    ("/v1/completions", {"prompt": "please <<fail>>", "max_tokens": 8}),
]
SETTINGS = {"max_num_seqs": 4, "mock_context_length": 256, "max_body_bytes": 1024}


def without_instance_fields(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if key not in ("id", "created")}


async def test_every_answer_is_the_http_endpoints_own(tmp_path):
    lines = [batch_line(f"case-{i}", body, url) for i, (url, body) in enumerate(CASES)]
    config = batch_config(tmp_path, **SETTINGS)
    write_input(Path(config.input), lines)
    await run(config)
    output = read_output(Path(config.output))

    async with app_client(mock_config(**SETTINGS)) as http:
        for i, ((url, body), line) in enumerate(zip(CASES, output, strict=True)):
            content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
            served = await http.post(url, content=content)
            response = line["response"]
            assert line["custom_id"] == f"case-{i}" and line["error"] is None
            assert response["status_code"] == served.status_code, (i, served.json())
            if served.status_code == 200:
                assert without_instance_fields(response["body"]) == without_instance_fields(
                    served.json()
                ), i
                assert response["body"]["id"] == response["request_id"]
            else:
                assert response["body"] == served.json(), i
    statuses = {line["response"]["status_code"] for line in output}
    assert statuses == {200, 400, 413, 500}  # every kind of answer was compared


async def test_output_lines_are_read_back_by_the_openai_sdks_types(tmp_path):
    config = batch_config(tmp_path)
    write_input(
        Path(config.input),
        [
            batch_line("completion", {"prompt": "Hello", "max_tokens": 5}),
            batch_line("chat", chat_body("Hello", max_tokens=5), CHAT),
            batch_line("refused", {"prompt": "Hello", "top_p": 0}),
            "{not json",
            batch_line("streamed", {"prompt": "Hello", "stream": True}),
        ],
    )
    await run(config)
    completion, chat, refused, not_json, streamed = read_output(Path(config.output))

    for line in (completion, chat, refused):
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert set(line["response"]) == {"status_code", "request_id", "body"}
        assert line["id"].startswith("batch_req_")
    parsed = Completion.model_validate(completion["response"]["body"])
    assert parsed.object == "text_completion" and parsed.choices[0].finish_reason
    assert parsed.usage is not None and parsed.usage.completion_tokens >= 1
    answer = ChatCompletion.model_validate(chat["response"]["body"])
    assert answer.choices[0].message.role == "assistant" and answer.usage is not None
    error = ErrorObject.model_validate(refused["response"]["body"]["error"])
    assert (error.type, error.param, error.code) == (
        "invalid_request_error",
        "top_p",
        "invalid_value",
    )

    assert not_json["response"] is None and not_json["custom_id"] is None
    assert BatchError.model_validate(not_json["error"]) == BatchError(
        code="invalid_json", line=4, message=not_json["error"]["message"], param=None
    )
    assert BatchError.model_validate(streamed["error"]).code == "stream_unsupported"
    assert streamed["custom_id"] == "streamed"
    ids = [line["id"] for line in (completion, chat, refused, not_json, streamed)]
    assert len(set(ids)) == len(ids)


async def test_blank_lines_are_skipped_and_a_last_line_needs_no_line_end(tmp_path):
    config = batch_config(tmp_path)
    Path(config.input).write_text(
        "\n"
        + batch_line("a", {"prompt": "x", "max_tokens": 2})
        + "\n  \n\n"
        + batch_line("b", {"prompt": "y", "max_tokens": 2})
    )
    tally = await run(config)
    assert [line["custom_id"] for line in read_output(Path(config.output))] == ["a", "b"]
    assert (tally.ok, tally.failed) == (2, 0)


class SlotsMock(RecordingMock):
    """Records each step's number of rows and the step at which each prompt started."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rows_per_step: list[int] = []
        self.started_at_step: dict[bytes, int] = {}

    def step(self, batch: StepBatch) -> StepOutput:
        self.rows_per_step.append(len(batch.rows))
        for row in batch.rows:
            if row.position == 0:
                prompt = bytes(t for t in row.token_ids if t < 256)
                self.started_at_step[prompt] = len(self.rows_per_step)
        return super().step(batch)


async def test_long_and_short_lines_run_together_and_are_written_in_input_order(tmp_path):
    """Line 0 needs 300 steps; the 11 short lines behind it run in the other slots meanwhile
    (they finish first) and every slot is busy, yet the file is in input order."""
    model = SlotsMock(max_num_seqs=4)
    config = batch_config(tmp_path, max_num_seqs=4, max_pending_lines=16)
    long_body = {"prompt": "long", "max_tokens": 300, "ignore_eos": True}
    short = [batch_line(f"s{i}", {"prompt": f"short {i}", "max_tokens": 3}) for i in range(11)]
    write_input(Path(config.input), [batch_line("long", long_body), *short])
    await run(config, model)

    output = read_output(Path(config.output))
    assert [line["custom_id"] for line in output] == ["long"] + [f"s{i}" for i in range(11)]
    assert output[0]["response"]["body"]["usage"]["completion_tokens"] == 300
    # every short line started (and so finished, 3 tokens later) while the long one still had
    # most of its 300 steps to go: they completed out of input order
    shorts = [step for prompt, step in model.started_at_step.items() if prompt != b"long"]
    assert len(shorts) == 11 and max(shorts) < 60 and len(model.rows_per_step) >= 300
    assert max(model.rows_per_step) == 4  # all in flight at once up to the slots


class HeldEndpoints:
    """Answers each request only when the test releases its custom_id."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    async def answer(self, request: BatchRequest) -> EndpointAnswer:
        self.started.append(request.custom_id)
        released = self.release.setdefault(request.custom_id, asyncio.Event())
        await released.wait()
        return EndpointAnswer(f"id-{request.custom_id}", 200, {"done": request.custom_id})

    def let_go(self, custom_id: str) -> None:
        self.release.setdefault(custom_id, asyncio.Event()).set()


class RecordingSink(io.BytesIO):
    def custom_ids(self) -> list[str]:
        return [json.loads(line)["custom_id"] for line in self.getvalue().splitlines()]


async def test_results_finishing_out_of_order_wait_for_earlier_lines_and_the_window_holds():
    endpoints = HeldEndpoints()
    ids = [f"r{i}" for i in range(8)]
    data = "".join(batch_line(custom_id, {"prompt": "p"}) + "\n" for custom_id in ids)
    runner = BatchRunner(endpoints, LineParser(1024), max_pending_lines=3)  # type: ignore[arg-type]
    sink = RecordingSink()
    tally = BatchTally()
    progress = BatchProgress(Console(file=io.StringIO()), tally, enabled=False)
    reader = LineReader(io.BytesIO(data.encode()), name="in", max_line_bytes=4096)
    running = asyncio.create_task(
        runner.run(reader, sink, sink_name="out", tally=tally, progress=progress)
    )

    await wait_for(lambda: len(endpoints.started) == 3, what="the window filled")
    for _ in range(20):  # let every ready callback run: the window holds the fourth line back
        await asyncio.sleep(0)
    assert endpoints.started == ["r0", "r1", "r2"]

    endpoints.let_go("r2")
    endpoints.let_go("r1")  # done before r0: held, nothing written, no room made
    for _ in range(20):
        await asyncio.sleep(0)
    assert sink.custom_ids() == [] and len(endpoints.started) == 3

    endpoints.let_go("r0")  # r0, r1, r2 written at once; three more lines start
    await wait_for(lambda: sink.custom_ids() == ["r0", "r1", "r2"], what="r0-r2 written")
    await wait_for(lambda: len(endpoints.started) == 6, what="the window refilled")
    for custom_id in reversed(ids):
        endpoints.let_go(custom_id)
    await asyncio.wait_for(running, timeout=10)
    assert sink.custom_ids() == ids and tally.ok == 8


async def test_a_failing_model_step_fails_only_its_lines(tmp_path):
    config = batch_config(tmp_path, max_num_seqs=2, mock_fail_every=3)
    body = {"prompt": "p", "max_tokens": 2, "ignore_eos": True}
    write_input(Path(config.input), [batch_line(f"r{i}", body) for i in range(6)])
    tally = await run(config)
    statuses = [line["response"]["status_code"] for line in read_output(Path(config.output))]
    assert 500 in statuses and 200 in statuses
    assert tally.failed_by_cause["500"] == statuses.count(500)


class BreakingStream(io.RawIOBase):
    """Two good lines, then an I/O error."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.calls = 0

    def readable(self) -> bool:
        return True

    def read1(self, size: int = -1) -> bytes:
        self.calls += 1
        if self.calls == 1:
            return self.data
        raise OSError(5, "Input/output error")


class ImmediateEndpoints:
    async def answer(self, request: BatchRequest) -> EndpointAnswer:
        return EndpointAnswer(f"id-{request.custom_id}", 200, {})


async def test_a_reading_failure_fails_the_run_after_writing_the_lines_before_it():
    data = "".join(batch_line(f"r{i}", {"prompt": "p"}) + "\n" for i in range(2)).encode()
    runner = BatchRunner(ImmediateEndpoints(), LineParser(1024), max_pending_lines=4)  # type: ignore[arg-type]
    sink = RecordingSink()
    tally = BatchTally()
    reader = LineReader(BreakingStream(data), name="in.jsonl", max_line_bytes=4096)
    with pytest.raises(BatchFailed, match="^cannot read in.jsonl: Input/output error$"):
        await runner.run(
            reader,
            sink,
            sink_name="out",
            tally=tally,
            progress=BatchProgress(Console(file=io.StringIO()), tally, enabled=False),
        )
    assert sink.custom_ids() == ["r0", "r1"]


async def test_ten_thousand_lines_in_bounded_memory_read_as_they_are_answered(tmp_path):
    """The input is 10,000 lines of ~2 KB (21 MB). Streamed, the run holds at most the window
    (64 lines) and the reader's chunks; read whole, it would hold the file, several times over
    as Python objects. Sampled with psutil during the run: the resident set grows by far less
    than the file, and the output is being written while most of the input is still unread.

    Each line's prompt is ~200 bytes, the rest of its ~2 KB the ``user`` field (accepted and
    ignored, read and parsed with the line): the mock's cost is per prompt token (a ~2 KB
    prompt is ~2,000 of them: most of the run), and the 10,000 prompts are still ~2 million
    tokens, over 10 MiB as tuples of ids, were they kept."""
    config = batch_config(tmp_path, max_num_seqs=16, max_pending_lines=64)
    path = Path(config.input)
    with path.open("w") as file:
        for i in range(10_000):
            prompt = f"{i} " + "abcdefghij " * 18
            padding = {"max_tokens": 2, "user": "abcdefghij " * 162}
            url, body = (
                ("/v1/completions", {"prompt": prompt, **padding})
                if i % 2
                else (CHAT, chat_body(prompt, **padding))
            )
            file.write(batch_line(f"line-{i}", body, url) + "\n")
    input_size = path.stat().st_size
    assert input_size > 20 * MIB

    warm_up = batch_config(
        tmp_path, input=str(tmp_path / "warm.jsonl"), output=str(tmp_path / "warm.out")
    )
    write_input(Path(warm_up.input), [batch_line("w", {"prompt": "w", "max_tokens": 2})])
    await run(warm_up)

    process = psutil.Process()
    baseline = process.memory_info().rss
    samples: list[tuple[int, int, int]] = []  # (rss, input position, output size)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):  # a measurement's sampling period, not a wait for a result
            position = next(
                (f.position for f in process.open_files() if f.path == str(path)), input_size
            )
            output = Path(config.output)
            samples.append(
                (
                    process.memory_info().rss,
                    position,
                    output.stat().st_size if output.exists() else 0,
                )
            )

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        tally = await run(config)
    finally:
        done.set()
        sampler.join()

    assert (tally.ok, tally.failed) == (10_000, 0)
    output = read_output(Path(config.output))
    assert [line["custom_id"] for line in output] == [f"line-{i}" for i in range(10_000)]
    growth = max(rss for rss, _, _ in samples) - baseline
    # measured ~4.6 MiB (the window, the custom ids seen, allocator slack); ~26 MiB when the
    # reader takes the whole file at once
    assert growth < 10 * MIB, f"resident set grew by {growth / MIB:.1f} MiB"
    assert any(0 < written and position < input_size / 2 for _, position, written in samples)


async def test_the_bar_counts_to_the_files_total_and_shows_tokens_per_second(tmp_path):
    config = batch_config(tmp_path, progress=True)
    lines = [batch_line(f"r{i}", {"prompt": "p", "max_tokens": 3}) for i in range(5)]
    write_input(Path(config.input), lines)
    screen = io.StringIO()
    tally = BatchTally()
    progress = BatchProgress(Console(file=screen, width=120), tally, enabled=True)
    await run_batch(config, tally, progress)
    progress.print_summary()
    shown = screen.getvalue()
    assert "5/5 requests" in shown and " tok/s" in shown
    assert "batch: 5 requests in " in shown and ": 5 ok, 0 failed" in shown
