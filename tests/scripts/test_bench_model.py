"""scripts/bench_model.py's waves (scenarios/model_serving.py, on loadgen) against a real mock
server: the token counts, token ids and first-token times its tok/s and agreement figures rest
on."""

from __future__ import annotations

import pytest
from harness.server import ServerSpec, running
from loadgen import Api
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
    wave = await bench_model.run_wave(mock_url, Api.NATIVE, prompts, MAX_TOKENS)

    assert len(wave.streams) == 6
    for record in wave.streams:
        assert record.completion_tokens == MAX_TOKENS
        assert len(record.token_ids) == MAX_TOKENS
        assert record.prompt_tokens and record.prompt_tokens > 0
        assert record.sent_at < record.first_token_at <= record.done_at
    # the mock is deterministic: the same prompt gives the same tokens (API.md, greedy)
    again = await bench_model.run_wave(mock_url, Api.NATIVE, prompts, MAX_TOKENS)
    assert [r.token_ids for r in again.streams] == [r.token_ids for r in wave.streams]
    assert wave.tokens_per_s == pytest.approx(6 * MAX_TOKENS / wave.wall_s)


@pytest.mark.slow
async def test_openai_wave_counts_tokens_from_usage(mock_url) -> None:
    prompts = [bench_model.make_prompt(i) for i in range(3)]
    wave = await bench_model.run_wave(mock_url, Api.OPENAI, prompts, MAX_TOKENS)

    for record in wave.streams:
        assert record.completion_tokens == MAX_TOKENS
        assert record.prompt_tokens and record.prompt_tokens > 0
        assert record.first_token_at is not None
        assert record.sent_at < record.first_token_at <= record.done_at


@pytest.mark.slow
async def test_a_wave_with_a_refused_request_raises(mock_url) -> None:
    """A wave's figures are only those of whole answers: a refused stream is an error."""
    with pytest.raises(RuntimeError, match="request 0: error 422 invalid_request"):
        await bench_model.run_wave(mock_url, Api.NATIVE, ["too long"], 10**9)


def test_server_setups_parse_threads_and_the_eager_path() -> None:
    fused = bench_model.ServerSetup.parse("bfloat16:int4")
    eager = bench_model.ServerSetup.parse("bfloat16:none:1:eager")
    assert (fused.quantization, fused.threads, fused.eager) == ("int4", None, False)
    assert (eager.quantization, eager.threads, eager.eager) == ("none", 1, True)
    assert eager.name == "slotserve bfloat16 1T eager"
    command = list(eager.spec(max_num_seqs=4, max_model_len=64, threads=2).argv)
    assert command[command.index("--torch-threads") + 1] == "1"
    assert command[-2:] == ["--fused-decode", "false"]
    assert "--fused-decode" not in fused.spec(max_num_seqs=4, max_model_len=64, threads=2).argv
