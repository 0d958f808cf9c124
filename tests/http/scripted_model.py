"""A mock model that writes a fixed script: for tests of how answers are read (tool calls,
reasoning), where the text must be known to the byte."""

from __future__ import annotations

import time

from app.models.base import StepBatch, StepOutput
from app.models.mock import MOCK_EOS_TOKEN_ID, ByteTokenizer, MockModelRunner


class ScriptedModel(MockModelRunner):
    """Answers every prompt with ``script`` one byte a token (then EOS), with the tokenizer's
    ``chat_template``, taking ``step_s`` seconds a step; keeps the prompts it was given."""

    def __init__(
        self, script: str, chat_template: str | None = None, step_s: float = 0.0, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.step_s = step_s
        tokenizer = ByteTokenizer()
        tokenizer.chat_template = chat_template  # type: ignore[attr-defined]
        self.tokenizer = tokenizer
        self.script = script.encode()
        self.prompts: list[str] = []
        self._written = [0] * self.capabilities.max_num_seqs

    def step(self, batch: StepBatch) -> StepOutput:
        if self.step_s:
            time.sleep(self.step_s)  # the model's time, on the model thread
        tokens: list[int | None] = []
        for row in batch.rows:
            if row.position == 0:
                self._written[row.slot] = 0
                self.prompts.append(bytes(t for t in row.token_ids if t < 256).decode())
            if not row.sample:
                tokens.append(None)
                continue
            written = self._written[row.slot]
            script = self.script
            tokens.append(script[written] if written < len(script) else MOCK_EOS_TOKEN_ID)
            self._written[row.slot] = written + 1
        return StepOutput.of_token_ids(tokens)
