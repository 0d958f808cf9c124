"""What an engine answers about prompts without running the model: tokens, text, the chat
template and compiled constraints, for the request builder (``app.api.request_builder``).

``AsyncEngine`` and ``SyncEngine`` both offer these, over the ``PromptEncoder`` and the
``ConstraintCompiler`` each builds for its model; this is the one place that says how.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.constraints import CompiledConstraint, ConstraintCompiler, ConstraintSpec
from app.engine.chat_template import ChatMessage, ChatTemplate
from app.engine.prompt_encoder import PromptEncoder


class PromptOperations:
    """The engines' prompt operations (a base class: the engine sets ``_prompts`` and
    ``_constraints`` in its constructor). Each is CPU-bound (tokenizing a long text, compiling
    a schema on a cache miss): an event loop runs them on a worker thread."""

    _prompts: PromptEncoder
    _constraints: ConstraintCompiler

    @property
    def chat_template(self) -> ChatTemplate:
        """The template chats are rendered with: the model's own, or the ChatML fallback."""
        return self._prompts.chat_template

    @property
    def chat_stop_strings(self) -> tuple[str, ...]:
        """``PromptEncoder.chat_stop_strings``."""
        return self._prompts.chat_stop_strings

    def encode_text(self, text: str) -> tuple[int, ...]:
        """``PromptEncoder.encode_text``.

        Raises:
            TokenizationError: the tokenizer failed.
        """
        return self._prompts.encode_text(text)

    def decode(self, token_ids: tuple[int, ...], *, special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (``PromptEncoder.decode``; /detokenize with
        ``special_tokens``).

        Raises:
            TokenizationError: the tokenizer failed.
        """
        return self._prompts.decode(token_ids, special_tokens=special_tokens)

    def token_bytes(self, token_ids: tuple[int, ...]) -> list[bytes]:
        """Each token's own bytes (logprobs answers)."""
        return self._prompts.token_bytes(token_ids)

    def encode_chat(
        self,
        messages: tuple[ChatMessage, ...],
        tools: tuple[dict[str, Any], ...] = (),
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> tuple[int, ...]:
        """``PromptEncoder.encode_chat``: the conversation rendered by :attr:`chat_template`.

        Raises:
            ChatTemplateError: the template refused the conversation.
            TokenizationError: the tokenizer failed on the rendered text.
        """
        return self._prompts.encode_chat(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
            continue_final_message=continue_final_message,
        )

    def compile_constraint(self, spec: ConstraintSpec) -> CompiledConstraint:
        """``ConstraintCompiler.compile`` for this model (ms to hundreds of ms on a miss).

        Raises:
            ConstraintError: the constraint cannot be compiled (the reason in the message).
        """
        return self._constraints.compile(spec)
