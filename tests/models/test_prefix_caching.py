"""The real runner under the paged scheduler: prefix caching and preemption change no token.

Requests are seeded greedy ones (``batch_invariant``: the exact path, API.md's promise), so
"identical" is bit-exact: a cached prefix, computed by another request in other chunks, must give
the same tokens as computing it again, and a preempted sequence recomputed from its prompt and
generated tokens must go on exactly as it would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.engine.request import GenerationRequest
from app.engine.sync_engine import SyncEngine
from app.models.base import SamplingParams
from app.models.forward.kv_cache import KV_BLOCK_SIZE, kv_block_bytes
from app.models.load.plan import load_checkpoint
from app.models.runner import ModelRunner
from tests.checkpoints import TinyCheckpoints

SEEDED_GREEDY = SamplingParams(temperature=0.0, seed=1, batch_invariant=True)
SEEDED_SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=5, batch_invariant=True)
# The penalties count the prompt (a cached prefix included) and the generated tokens (those
# before a preemption included): a sampler that lost either would change these tokens.
SEEDED_PENALISED = SamplingParams(
    temperature=0.9,
    seed=5,
    batch_invariant=True,
    presence_penalty=0.8,
    frequency_penalty=0.6,
    repetition_penalty=1.6,
    min_tokens=30,
)
SYSTEM = (
    "<|im_start|>system\nYou are a helpful assistant who answers in one short sentence and "
    "never makes anything up.<|im_end|>\n"
)


def _generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    *,
    caching: bool,
    max_tokens: int = 8,
    sampling: SamplingParams = SEEDED_GREEDY,
) -> tuple[list[tuple[int, ...]], SyncEngine]:
    engine = SyncEngine(runner, prefix_caching=caching)
    handles = [
        engine.add(
            GenerationRequest(
                request_id=f"r{index}",
                prompt_token_ids=tuple(prompt),
                max_tokens=max_tokens,
                sampling=sampling,
            )
        )
        for index, prompt in enumerate(prompts)
    ]
    engine.run_until_idle(max_steps=10_000)
    blocks = engine.scheduler.kv_blocks
    assert blocks is not None
    blocks.check()
    assert blocks.num_used_blocks == 0, "leaked blocks"
    outputs = []
    for handle in handles:
        assert handle.final is not None and handle.final.error is None
        outputs.append(handle.final.token_ids)
    return outputs, engine


def _hits(engine: SyncEngine) -> float:
    value = engine.metrics.registry.get_sample_value("slotserve_prefix_cache_hits_total")
    return 0.0 if value is None else value


def test_smollm2_shared_system_prompt_same_tokens_with_caching(runner: ModelRunner) -> None:
    encode = runner.tokenizer.encode
    questions = ["What is the capital of France?", "Name a prime number.", "Say hello."]
    prompts = [
        encode(f"{SYSTEM}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
        for q in questions
    ]
    off, _ = _generate(runner, prompts, caching=False)
    on, engine = _generate(runner, prompts, caching=True)
    assert on == off
    system_blocks = len(encode(SYSTEM)) // KV_BLOCK_SIZE
    assert system_blocks >= 1
    assert _hits(engine) >= 2 * system_blocks * KV_BLOCK_SIZE


def test_smollm2_multi_turn_same_tokens_with_caching(runner: ModelRunner) -> None:
    encode = runner.tokenizer.encode
    engine = SyncEngine(runner, prefix_caching=True)
    conversation = SYSTEM
    for turn, question in enumerate(["Hi!", "What is 2 + 2?", "And 3 + 3?"]):
        conversation += f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        prompt = encode(conversation)
        handle = engine.add(
            GenerationRequest(f"t{turn}", tuple(prompt), max_tokens=8, sampling=SEEDED_GREEDY)
        )
        engine.run_until_idle(max_steps=1000)
        assert handle.final is not None
        alone, _ = _generate(runner, [prompt], caching=False)
        assert handle.final.token_ids == alone[0]
        conversation += handle.final.text + "<|im_end|>\n"
    assert _hits(engine) > 0
    assert engine.scheduler.kv_blocks is not None
    assert engine.scheduler.kv_blocks.num_used_blocks == 0


@pytest.fixture(scope="module")
def tiny_runners(tiny_checkpoints: TinyCheckpoints) -> Iterator:
    """``tiny_runners(architecture, kv_blocks)``: a tiny model's runner with 4 slots of 128
    positions, its KV pool the default (``kv_blocks`` None) or ``kv_blocks`` blocks, loaded
    once per module and shared as the session's SmolLM2 runner is: every engine built on it
    frees its blocks (``_generate`` checks it)."""
    loaded: dict[tuple[str, int | None], ModelRunner] = {}

    def runner(architecture: str, kv_blocks: int | None = None) -> ModelRunner:
        if (architecture, kv_blocks) not in loaded:
            path: Path = tiny_checkpoints.hf(architecture)
            memory = None
            if kv_blocks is not None:
                roomy = runner(architecture).model
                memory = kv_blocks * kv_block_bytes(roomy.hparams, dtype=roomy.dtype)
            loaded[architecture, kv_blocks] = load_checkpoint(
                path, max_num_seqs=4, max_model_len=128, kv_cache_memory=memory
            )
        return loaded[architecture, kv_blocks]

    yield runner
    loaded.clear()


@pytest.mark.parametrize(
    ("architecture", "sampling"),
    [
        ("llama", SEEDED_GREEDY),
        ("qwen3", SEEDED_GREEDY),
        ("llama", SEEDED_SAMPLED),
        ("llama", SEEDED_PENALISED),
    ],
)
def test_tiny_models_same_tokens_with_caching_and_under_preemption(
    tiny_runners, architecture: str, sampling: SamplingParams
) -> None:
    roomy = tiny_runners(architecture)
    shared = list(range(5, 5 + 40))
    prompts = [shared + [100 + i, 7, 8 + i] for i in range(4)] + [shared[:32], [3]]
    off, _ = _generate(roomy, prompts, caching=False, max_tokens=40, sampling=sampling)
    on, _ = _generate(roomy, prompts, caching=True, max_tokens=40, sampling=sampling)
    assert on == off
    # 12 blocks for 4 slots whose sequences grow to 6 blocks each: decode runs out of blocks.
    tiny = tiny_runners(architecture, kv_blocks=12)
    assert tiny.capabilities.num_kv_blocks == 13
    for caching in (True, False):
        preempted, engine = _generate(
            tiny, prompts, caching=caching, max_tokens=40, sampling=sampling
        )
        assert preempted == off
        count = engine.metrics.registry.get_sample_value("slotserve_preemptions_total")
        assert count is not None and count > 0
