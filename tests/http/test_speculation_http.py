"""``--speculative-ngram`` through the server: the same streamed and whole answers as without
it, the setting and the acceptance rate on ``/info``, the counters under both names."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from app.models.mock import MockModelRunner
from tests.http.conftest import app_client, mock_config, parse_sse

PROMPTS = ["one two one two one two", "abc abc abc", "the cat sat on the mat, the cat"]


def _markov_mock() -> MockModelRunner:
    """The mock as a Markov chain over its last 3 bytes: its text repeats, drafts land. Its
    steps take 5 ms however many positions they hold, so the server measures a drafted token
    as nearly free and drafts; with instant steps the measured cost was the machine's noise,
    and on a loaded machine it stopped drafting (acceptance rate 0, a flake)."""
    return MockModelRunner(
        max_num_seqs=4, context_length=512, kv_blocks=256, order=3, eos_one_in=1000, step_ms=5.0
    )


async def _answers(speculative_ngram: int) -> tuple[list[str], list[str], dict, str]:
    config = mock_config(speculative_ngram=speculative_ngram)
    async with app_client(config, model=_markov_mock()) as client:
        whole, streamed = [], []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 60, "ignore_eos": True}
            whole.append((await client.post("/generate", json=body)).json()["text"])
            response = await client.post("/generate", json={**body, "stream": True})
            events = parse_sse(response.text)
            streamed.append("".join(d["text"] for name, d in events if name == "token"))
        info = (await client.get("/info")).json()
        metrics = (await client.get("/metrics")).text
    return whole, streamed, info, metrics


async def test_answers_are_the_same_with_speculation_and_it_is_reported() -> None:
    off_whole, off_streamed, off_info, _ = await _answers(0)
    on_whole, on_streamed, info, metrics = await _answers(4)
    assert on_whole == off_whole and on_streamed == off_streamed == off_whole
    assert (off_info["speculative_ngram"], off_info["spec_decode_acceptance_rate"]) == (0, None)
    assert info["speculative_ngram"] == 4
    assert 0 < info["spec_decode_acceptance_rate"] <= 1
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    drafted = samples["slotserve_spec_decode_num_draft_tokens_total"]
    accepted = samples["slotserve_spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and accepted / drafted == info["spec_decode_acceptance_rate"]
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] == accepted
