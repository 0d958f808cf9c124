"""The Python API (app/llm.py) on the mock: loading by the server's names and flags, results
equal to the server's engine, validation before any work, failures kept to their requests."""

from __future__ import annotations

import httpx
import pydantic
import pytest

from app.api.schemas import GenerateRequestBody
from app.api.server import create_app
from app.config import ServerConfig
from app.engine.engine import AsyncEngine
from app.engine.request import GenerationRequest
from app.llm import LLM, Generation, SamplingOptions
from app.models.base import SamplingParams, StepBatch, StepOutput
from app.models.mock import MOCK_EOS_TOKEN_ID, MockModelRunner
from app.models.refusal import ModelRefused

PROMPTS = [f"prompt {i} 中文" for i in range(7)]


def test_loads_the_mock_by_name_with_the_servers_settings():
    llm = LLM("mock", max_num_seqs=3, mock_context_length=64)
    assert isinstance(llm.model, MockModelRunner)
    assert (llm.capabilities.max_num_seqs, llm.capabilities.context_length) == (3, 64)
    assert llm.config.max_num_seqs == 3


@pytest.mark.parametrize(
    "settings", [{"model": "mock", "max_num_seqs": 0}, {"model": "mock", "x": 1}]
)
def test_bad_settings_are_refused_as_the_server_refuses_its_flags(settings):
    with pytest.raises(pydantic.ValidationError):
        LLM(**settings)


def test_a_model_that_cannot_be_served_is_refused_as_the_server_refuses_it():
    """--model takes a path too (issue 8): a name that is neither a bundled model nor a path is
    the loader's one-line refusal, as on the command line."""
    with pytest.raises(ModelRefused, match="^no-such-model: no such file or directory$"):
        LLM(model="no-such-model")


async def test_same_results_as_the_servers_engine():
    options = SamplingOptions(max_tokens=40, temperature=0)
    offline = LLM(MockModelRunner(max_num_seqs=3)).generate(PROMPTS, options)

    engine = AsyncEngine(MockModelRunner(max_num_seqs=3))
    await engine.start()
    try:
        handles = [
            engine.submit(
                GenerationRequest(
                    request_id=str(i),
                    prompt_token_ids=tuple(text.encode()),
                    max_tokens=40,
                    sampling=SamplingParams(temperature=0.0),
                )
            )
            for i, text in enumerate(PROMPTS)
        ]
        served = [await handle.result() for handle in handles]
    finally:
        await engine.stop()
    assert [(g.text, g.token_ids, g.finish_reason) for g in offline] == [
        (f.text, f.token_ids, f.finish_reason.value) for f in served
    ]
    assert {g.finish_reason for g in offline} == {"stop", "length"}  # both kinds occur


def test_results_in_prompt_order_and_each_as_if_alone():
    llm = LLM(MockModelRunner(max_num_seqs=2))
    together = llm.generate(PROMPTS, SamplingOptions(max_tokens=30))
    assert [g.prompt for g in together] == PROMPTS
    assert len({g.request_id for g in together}) == len(PROMPTS)
    for g in together:
        (alone,) = llm.generate(g.prompt, SamplingOptions(max_tokens=30))
        assert (alone.text, alone.token_ids) == (g.text, g.token_ids)
        assert g.prompt_token_ids == tuple(g.prompt.encode())
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == MOCK_EOS_TOKEN_ID
        else:
            assert len(g.token_ids) == 30
        # an unfinished character at a length cut is held back, never completed: dropped
        assert g.text == bytes(t for t in g.token_ids if t < 256).decode(errors="ignore")


def test_a_single_prompt_gives_a_list_of_one():
    (only,) = LLM("mock").generate("hi", SamplingOptions(max_tokens=3, ignore_eos=True))
    assert isinstance(only, Generation) and len(only.token_ids) == 3


def test_stop_string_stop_token_ignore_eos_and_max_tokens_zero():
    llm = LLM(MockModelRunner(max_num_seqs=4))
    (free,) = llm.generate("the prompt", SamplingOptions(max_tokens=40, ignore_eos=True))
    assert len(free.token_ids) == 40 and free.finish_reason == "length"
    stop = free.text[5:8]
    stop_token = free.token_ids[3]
    results = llm.generate(
        ["the prompt"] * 3,
        [
            SamplingOptions(max_tokens=40, ignore_eos=True, stop=[stop]),
            SamplingOptions(max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
            SamplingOptions(max_tokens=0),
        ],
    )
    by_string, by_token, empty = results
    assert by_string.finish_reason == "stop" and by_string.stop_reason == stop
    assert by_string.text == free.text[: free.text.index(stop)]
    assert by_token.stop_reason == stop_token and by_token.token_ids == free.token_ids[:4]
    assert (empty.text, empty.token_ids, empty.finish_reason) == ("", (), "length")


def test_sampling_options_follow_the_native_apis_bounds():
    native = GenerateRequestBody.model_json_schema()["properties"]
    ours = SamplingOptions.model_json_schema()["properties"]
    assert set(ours) == set(native) - {"prompt", "stream"}
    strip = {"title", "description", "type", "default"}
    for name, schema in ours.items():
        assert {k: v for k, v in schema.items() if k not in strip} == {
            k: v for k, v in native[name].items() if k not in strip
        }, name
        default = SamplingOptions.model_fields[name].get_default(call_default_factory=True)
        native_default = GenerateRequestBody.model_fields[name].get_default(
            call_default_factory=True
        )
        assert default == (tuple(native_default) if isinstance(default, tuple) else native_default)
    with pytest.raises(ValueError, match="temperature"):
        SamplingOptions(temperature=2.5)
    with pytest.raises(ValueError, match="unknown_field"):
        SamplingOptions(unknown_field=1)


def test_a_seed_asks_for_batch_invariance_as_in_the_server():
    class Recording(MockModelRunner):
        def __init__(self) -> None:
            super().__init__(max_num_seqs=2)
            self.sampling: list[SamplingParams] = []

        def step(self, batch: StepBatch) -> StepOutput:
            self.sampling.extend(row.sampling for row in batch.rows if row.position == 0)
            return super().step(batch)

    runner = Recording()
    LLM(runner).generate(
        ["a", "b"], [SamplingOptions(max_tokens=1, seed=7), SamplingOptions(max_tokens=1)]
    )
    seeded, unseeded = runner.sampling
    assert (seeded.seed, seeded.batch_invariant) == (7, True)
    assert unseeded.batch_invariant is False and 0 <= unseeded.seed < 2**63


@pytest.mark.parametrize(
    ("prompt", "options", "message"),
    [
        ("", SamplingOptions(max_tokens=2), "encodes to no tokens"),
        # two faults: the server's order of checks (RequestBuilder) reports the budget first
        ("", SamplingOptions(), "max_tokens must be <= 16"),
        ("x" * 20, SamplingOptions(max_tokens=0), "20 tokens, the limit is 16"),
        ("ok", SamplingOptions(max_tokens=17), "max_tokens must be <= 16"),
        ("0123456789", SamplingOptions(max_tokens=7), "exceed the context length of 16"),
        ("ok", SamplingOptions(max_tokens=2, stop_token_ids=[257]), "outside the vocabulary"),
        # token ids (found by a helper: a RuntimeError with the tokenizer's traceback logged)
        ([72, 105], SamplingOptions(max_tokens=2), "a prompt is a string, got list"),
    ],
)
def test_an_invalid_prompt_is_refused_before_any_work(prompt, options, message):
    runner = MockModelRunner(max_num_seqs=2, context_length=16)
    llm = LLM(runner)
    with pytest.raises(ValueError, match=rf"prompts\[1\]: .*{message}"):
        llm.generate(["fine", prompt], [SamplingOptions(max_tokens=2), options])
    assert runner.num_model_calls == 0
    (after,) = llm.generate("fine", SamplingOptions(max_tokens=2, ignore_eos=True))
    assert len(after.token_ids) == 2  # nothing was left queued


@pytest.mark.parametrize("prompts", [None, b"abc", 5])
def test_prompts_that_are_no_string_nor_list_are_a_value_error(prompts):
    """``None`` was a TypeError and ``b"abc"`` "a prompt is a string, got int" (found by a
    helper): both are a ValueError naming what was given, as README promises."""
    with pytest.raises(ValueError, match=f"got {type(prompts).__name__}"):
        LLM("mock").generate(prompts)


@pytest.mark.parametrize("sampling", [{"max_tokens": 2}, ["not options"]])
def test_sampling_that_is_no_options_is_a_value_error(sampling):
    """A dict was read key by key: "'str' object has no attribute 'generation_params'"
    (found by a helper)."""
    with pytest.raises(ValueError, match="sampling: a SamplingOptions or a list of them, got"):
        LLM("mock").generate("x", sampling)


def test_sampling_list_of_another_length_is_refused():
    with pytest.raises(ValueError, match="1 sampling options for 2 prompts"):
        LLM("mock").generate(["a", "b"], [SamplingOptions()])


def test_a_failing_row_ends_only_its_request():
    llm = LLM(MockModelRunner(max_num_seqs=2))
    ok, failed, other = llm.generate(
        ["fine", "please <<fail>>", "also fine"], SamplingOptions(max_tokens=8)
    )
    assert failed.finish_reason == "error" and failed.error
    assert ok.finish_reason in {"stop", "length"} and other.finish_reason in {"stop", "length"}
    assert ok.error is None


def test_a_failing_step_ends_its_requests_with_an_error_and_the_rest_go_on():
    # two slots, four steps a pair: steps 1-4 serve p0 p1, step 5 (p2 p3) fails, 6-9 p4 p5
    runner = MockModelRunner(max_num_seqs=2, fail_every=5)
    results = LLM(runner).generate(
        [f"p{i}" for i in range(6)], SamplingOptions(max_tokens=4, ignore_eos=True)
    )
    assert [g.finish_reason for g in results] == ["length"] * 2 + ["error"] * 2 + ["length"] * 2
    assert {g.error for g in results[2:4]} == {"the model failed on this request"}
    assert all(len(g.token_ids) == 4 for g in results[:2] + results[4:])


def test_an_interrupted_generate_leaves_nothing_for_the_next_call():
    class Interrupting(MockModelRunner):
        interrupt = True

        def step(self, batch: StepBatch) -> StepOutput:
            if self.interrupt and self.num_model_calls == 2:
                self.interrupt = False
                raise KeyboardInterrupt
            return super().step(batch)

    llm = LLM(Interrupting(max_num_seqs=2))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b", "c", "d"], SamplingOptions(max_tokens=5, ignore_eos=True))
    results = llm.generate(["e"], SamplingOptions(max_tokens=5, ignore_eos=True))
    assert [g.prompt for g in results] == ["e"] and len(results[0].token_ids) == 5


def test_static_scheduling_setting_is_used():
    runner = MockModelRunner(max_num_seqs=2)
    lengths = [1, 6, 1, 6]  # static: 6 + 6 steps; continuous: 7
    LLM(runner, scheduling="static").generate(
        [f"p{i}" for i in range(4)],
        [SamplingOptions(max_tokens=n, ignore_eos=True) for n in lengths],
    )
    assert runner.num_model_calls == 12


@pytest.mark.parametrize(
    ("prompt", "options"),
    [
        ("x" * 20, SamplingOptions(max_tokens=0)),
        ("ok", SamplingOptions(max_tokens=17)),
        ("0123456789", SamplingOptions(max_tokens=7)),
        ("ok", SamplingOptions(max_tokens=2, stop_token_ids=[257])),
    ],
)
async def test_refusals_are_the_http_routes_own(prompt, options):
    """One set of checks: the Python API refuses what POST /generate refuses, with its message
    (``prompt`` is the field's name on the wire; ``prompts[i]`` names the list entry here).
    An empty prompt is not here: /generate's schema refuses it before the builder sees it."""
    config = ServerConfig(model="mock", max_num_seqs=2)
    app = create_app(config, model=MockModelRunner(max_num_seqs=2, context_length=16))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            body = {"prompt": prompt, **options.model_dump(exclude_defaults=True)}
            answer = await http.post("/generate", json=body)
    assert answer.status_code in (400, 422)
    served = answer.json()["error"]["message"]
    with pytest.raises(ValueError) as refused:
        LLM(MockModelRunner(max_num_seqs=2, context_length=16)).generate(prompt, options)
    assert str(refused.value) == f"prompts[0]: {served}"
