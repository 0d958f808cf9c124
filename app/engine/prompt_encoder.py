"""Prompts into token ids: the one place the model's tokenizer encodes what a client sent.

Both engines own one (``AsyncEngine`` for the server and the batch runner, ``SyncEngine`` for the
Python API) and offer its operations as their own, so the edge reads the model only through an
engine (rule R11) and the request builder works on either.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from app.engine.chat_template import (
    CHATML_END_OF_TURN,
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    syntax_error,
)
from app.models.base import Tokenizer

logger = logging.getLogger(__name__)


class TokenizationError(Exception):
    """The model's tokenizer failed on a text (the cause is chained)."""


class PromptEncoder:
    """Encodes plain prompts and conversations with one model's tokenizer and chat template.

    Args:
        tokenizer: the model's tokenizer (its ``chat_template``, when it has one, renders chats).
        model_name: names the model in the log line about a missing chat template.
        chat_template: a template source that replaces the model's (``--chat-template``).
    """

    def __init__(
        self, tokenizer: Tokenizer, model_name: str, *, chat_template: str | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self.chat_template = ChatTemplate.of(tokenizer, override=chat_template)
        own = getattr(tokenizer, "chat_template", None)
        problem = syntax_error(own) if own and chat_template is None else None
        if problem is not None:  # (found by a helper: every chat was then a 400 on its messages)
            logger.warning(
                "%s's chat template is not valid Jinja (%s): chats are rendered as ChatML "
                "(--chat-template FILE replaces it)",
                model_name,
                problem,
            )
        elif not self.chat_template.from_model:
            logger.info("%s has no chat template: chats are rendered as ChatML", model_name)

    @property
    def chat_stop_strings(self) -> tuple[str, ...]:
        """Stop strings every chat gets: ChatML's end of turn where the ChatML fallback renders
        chats (a model without a template of its own, whose tokenizer may not know
        ``<|im_end|>`` as a token: Gemma 3's base file wrote it as text, then another turn,
        to ``max_tokens``; found by a helper), else none."""
        return () if self.chat_template.from_model else (CHATML_END_OF_TURN,)

    def encode_text(self, text: str) -> tuple[int, ...]:
        """The token ids of a plain prompt. CPU-bound (~1 s for 1 MB): long texts belong off
        an event loop.

        Raises:
            TokenizationError: the tokenizer failed.
        """
        try:
            return tuple(self._tokenizer.encode(text))
        except Exception as exc:
            raise TokenizationError(str(exc)) from exc

    def encode_chat(
        self,
        messages: tuple[ChatMessage, ...],
        tools: tuple[dict[str, Any], ...] = (),
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> tuple[int, ...]:
        """The token ids of a conversation rendered by :attr:`chat_template`, ending where the
        assistant's answer begins (after the last message with
        ``add_generation_prompt=False``); ``tools`` are the functions the model may call and
        ``template_kwargs`` more template variables (see ``ChatTemplate.render``).
        ``continue_final_message`` (vLLM's and transformers' flag; no generation prompt is
        added then, whatever ``add_generation_prompt`` says): the rendered text ends where the
        last message's content ends, that message left open for the model to continue.

        Raises:
            ChatTemplateError: the template refused the conversation (roles out of order...), or
                the last message's content is not in the rendered text.
            TokenizationError: the tokenizer failed on the rendered text.
        """
        text = self.chat_template.render(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            template_kwargs=template_kwargs,
        )
        if continue_final_message:
            text = _open_final_message(text, messages[-1].content)
        # A model's template writes BOS itself: a tokenizer that adds one to plain prompts must
        # not add a second (vLLM encodes chats with add_special_tokens=False too). The ChatML
        # fallback writes none: there the tokenizer adds its BOS as to a plain prompt (Gemma 3's
        # base file answered "assistant\nassistant..." without it; found by a helper). The
        # mock's byte tokenizer adds none and has no such method.
        encode = getattr(self._tokenizer, "encode_without_special_tokens", None)
        if encode is None or not self.chat_template.from_model:
            return self.encode_text(text)
        try:
            return tuple(encode(text))
        except Exception as exc:
            raise TokenizationError(str(exc)) from exc

    def decode(self, token_ids: tuple[int, ...], *, special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (bytes that are not UTF-8 become U+FFFD); with
        ``special_tokens``, control tokens as their own text (``/detokenize``) where the
        tokenizer has it (the mock's byte tokenizer has none).

        Raises:
            TokenizationError: the tokenizer failed (an id outside its vocabulary...).
        """
        decode = self._tokenizer.decode_bytes
        if special_tokens:
            decode = getattr(self._tokenizer, "decode_bytes_with_special_tokens", decode)
        try:
            return decode(token_ids).decode("utf-8", errors="replace")
        except Exception as exc:
            raise TokenizationError(str(exc)) from exc

    def token_bytes(self, token_ids: tuple[int, ...]) -> list[bytes]:
        """Each token's own bytes (a token may hold part of a UTF-8 character)."""
        return [self._tokenizer.decode_bytes((token,)) for token in token_ids]


def _open_final_message(text: str, content: str) -> str:
    """``text`` cut right after the last occurrence of ``content`` (stripped, as templates
    often strip it). Raises ChatTemplateError when it does not occur."""
    final = content.strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the last message's content is not in the rendered prompt"
        )
    return text[: at + len(final)]
