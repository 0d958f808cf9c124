"""scripts/bench_model.py's HTTP client (scenarios/model_serving.py) against a real mock server:
the token counts, token ids and first-token times its tok/s and agreement figures rest on."""

from __future__ import annotations

import pytest
from harness.server import ServerSpec, running
from scenarios import model_serving as bench_model

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def mock_url(tmp_path_factory):
    spec = ServerSpec.mock("bench-model-client", step_ms=2, max_num_seqs=4)
    with running(spec, tmp_path_factory.mktemp("logs")) as server:
        yield server.url


@pytest.mark.slow
async def test_native_wave_counts_every_streamed_token(mock_url) -> None:
    prompts = [bench_model.make_prompt(i) for i in range(6)]  # more streams than slots
    wave = await bench_model.run_wave(bench_model.NativeEndpoint(mock_url), prompts, MAX_TOKENS)

    assert len(wave.streams) == 6
    for record in wave.streams:
        assert record.completion_tokens == MAX_TOKENS
        assert len(record.token_ids) == MAX_TOKENS
        assert record.prompt_tokens and record.prompt_tokens > 0
        assert record.sent_at < record.first_token_at <= record.done_at
    # the mock is deterministic: the same prompt gives the same tokens (API.md, greedy)
    again = await bench_model.run_wave(bench_model.NativeEndpoint(mock_url), prompts, MAX_TOKENS)
    assert [r.token_ids for r in again.streams] == [r.token_ids for r in wave.streams]
    assert wave.tokens_per_s == pytest.approx(6 * MAX_TOKENS / wave.wall_s)


@pytest.mark.slow
async def test_openai_wave_counts_tokens_from_usage(mock_url) -> None:
    prompts = [bench_model.make_prompt(i) for i in range(3)]
    wave = await bench_model.run_wave(bench_model.OpenAIEndpoint(mock_url), prompts, MAX_TOKENS)

    for record in wave.streams:
        assert record.completion_tokens == MAX_TOKENS
        assert record.prompt_tokens and record.prompt_tokens > 0
        assert record.first_token_at is not None
        assert record.sent_at < record.first_token_at <= record.done_at


@pytest.mark.slow
async def test_token_times_are_recorded_per_event(mock_url) -> None:
    times: list[float] = []
    body = {"prompt": bench_model.make_prompt(0), "max_tokens": MAX_TOKENS, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    async with bench_model.client_session(2) as http:
        await bench_model._record_token_times(
            http, mock_url, bench_model.make_prompt(0), MAX_TOKENS, times
        )
        async with http.post(f"{mock_url}/generate", json=body) as response:
            text, _ = await bench_model.read_stream(response, b"event: token")
    # one time per token event (a multi-byte character's tokens share one event)
    assert len(times) == text.count("event: token") > 0
    assert times == sorted(times)


def test_server_configs_parse_threads_and_the_eager_path() -> None:
    fused = bench_model.ServerConfig.parse("bfloat16:int4")
    eager = bench_model.ServerConfig.parse("bfloat16:none:1:eager")
    assert (fused.quantization, fused.threads, fused.eager) == ("int4", None, False)
    assert (eager.quantization, eager.threads, eager.eager) == ("none", 1, True)
    assert eager.name == "slotserve bfloat16 1T eager"
    command = list(eager.spec(max_num_seqs=4, max_model_len=64, threads=2).argv)
    assert command[command.index("--torch-threads") + 1] == "1"
    assert command[-2:] == ["--fused-decode", "false"]
    assert "--fused-decode" not in fused.spec(max_num_seqs=4, max_model_len=64, threads=2).argv
