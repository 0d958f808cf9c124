"""A test-only chat model: it says what a test needs, one byte a step, and listens to the seed.

It speaks the mock's byte vocabulary (``ByteTokenizer``: one token per UTF-8 byte, 256 is EOS),
so the server renders conversations with the ChatML fallback, and it answers the *last user
message* of the rendered prompt:

- ``say TEXT``: exactly TEXT (newlines and markup included), then EOS;
- a message with the word ``long``: words without end (only ``max_tokens`` or a cancel ends it);
- anything else: ``ANSWER_WORDS`` words drawn by a ``random.Random(seed)``, then EOS. The seed is
  the request's (the engine draws one when the client sends none), so the same seed gives the
  same answer and another seed, almost surely, another one.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

from app.models.base import ModelCapabilities, SamplingParams, StepBatch, StepOutput
from app.models.mock import MOCK_EOS_TOKEN_ID, MOCK_VOCAB_SIZE, ByteTokenizer

USER_TURN = "<|im_start|>user\n"  # the ChatML fallback's (app.engine.chat_template)
END_OF_TURN = "<|im_end|>"
ANSWER_WORDS = 12
WORDS = (
    "slot", "batch", "token", "stream", "prefill", "decode", "cache", "seed",
    "café", "naïve", "größe", "queue", "step", "sample", "answer", "model",
)  # fmt: skip


def last_user_message(prompt: str) -> str:
    """The text of the prompt's last user turn ("" when it has none)."""
    _, found, turn = prompt.rpartition(USER_TURN)
    return turn.partition(END_OF_TURN)[0] if found else ""


def answer_bytes(message: str, seed: int) -> Iterator[int]:
    """The answer to ``message``, as UTF-8 bytes (see the module doc)."""
    if message.startswith("say "):
        yield from message.removeprefix("say ").encode("utf-8")
        return
    rng = random.Random(seed)
    count = None if "long" in message.split() else ANSWER_WORDS
    spoken = 0
    while count is None or spoken < count:
        yield from ((" " if spoken else "") + rng.choice(WORDS)).encode("utf-8")
        spoken += 1


class ScriptedChatModel:
    """``Model`` protocol (``app.models.base``), stateless like the mock: it keeps each slot's
    prompt and the rest of its answer, and forgets them on ``release``.

    Args:
        max_num_seqs: slots.
        step_ms: sleep per step (ms), so that a stream lasts long enough to watch and stop.
        context_length: most tokens per sequence.
    """

    def __init__(
        self, *, max_num_seqs: int = 4, step_ms: float = 10.0, context_length: int = 8192
    ) -> None:
        self.tokenizer = ByteTokenizer()
        self.capabilities = ModelCapabilities(
            name="scripted-chat",
            backend="mock",
            context_length=context_length,
            max_num_seqs=max_num_seqs,
            vocab_size=MOCK_VOCAB_SIZE,
            eos_token_ids=frozenset({MOCK_EOS_TOKEN_ID}),
            keeps_kv_cache=False,
            max_tokens_per_row=context_length,
        )
        self.step_ms = step_ms
        self._prompts = [bytearray() for _ in range(max_num_seqs)]
        self._answers: list[Iterator[int] | None] = [None] * max_num_seqs
        self._lock = threading.Lock()
        self.started_sampling: list[SamplingParams] = []  # of every sequence, in start order

    def step(self, batch: StepBatch) -> StepOutput:
        with self._lock:
            tokens: list[int | None] = []
            for row in batch.rows:
                if row.position == 0:
                    self._prompts[row.slot] = bytearray()
                    self._answers[row.slot] = None
                    self.started_sampling.append(row.sampling)
                answer = self._answers[row.slot]
                if answer is None:  # still reading the prompt (later rows: its own tokens)
                    self._prompts[row.slot].extend(t for t in row.token_ids if t < 256)
                if not row.sample:
                    tokens.append(None)
                    continue
                if answer is None:
                    prompt = self._prompts[row.slot].decode("utf-8", errors="replace")
                    answer = answer_bytes(last_user_message(prompt), row.sampling.seed)
                    self._answers[row.slot] = answer
                tokens.append(next(answer, MOCK_EOS_TOKEN_ID))
            if self.step_ms > 0:
                time.sleep(self.step_ms / 1000.0)
            return StepOutput.of_token_ids(tokens)

    def release(self, slot: int) -> None:
        with self._lock:
            self._prompts[slot] = bytearray()
            self._answers[slot] = None
