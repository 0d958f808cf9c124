"""Raw token logprobs (``TokenLogprobs``) in OpenAI's two wire shapes: the legacy completions
one (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) and chat's
(``content: [{token, logprob, bytes, top_logprobs}]``).

A token's text is its own bytes decoded alone (a token holding part of a UTF-8 character
shows U+FFFD, as OpenAI and vLLM show it; ``bytes`` carries the exact bytes). ``text_offset``
counts characters of the choice's text before the token, decoding the tokens in order, so a
character split over two tokens is counted once, at the token that completes it.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Sequence

from app.api.openai.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)
from app.models.base import TokenLogprobs

TokenBytes = Callable[[tuple[int, ...]], list[bytes]]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


class LogprobsWriter:
    """Writes a sequence's logprobs in OpenAI's shapes (one per choice: it keeps the text
    offset of a streamed choice between chunks).

    Args:
        token_bytes: each token's own bytes (the engine's ``token_bytes``).
        hidden_token_ids: tokens left out (chat: those that end a message without being part
            of its text, EOS and the request's stop token ids).
        text_offset: characters already in the choice's text before the first token (the
            echoed prompt).
    """

    def __init__(
        self, token_bytes: TokenBytes, hidden_token_ids: frozenset[int], text_offset: int = 0
    ) -> None:
        self._token_bytes = token_bytes
        self._hidden = hidden_token_ids
        self._offset = text_offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _shown(self, logprobs: Iterable[TokenLogprobs | None]) -> list[TokenLogprobs | None]:
        return [e for e in logprobs if e is None or e.token_id not in self._hidden]

    def completion(
        self,
        logprobs: Sequence[TokenLogprobs],
        prompt: Sequence[TokenLogprobs | None] = (),
        first_prompt_id: int | None = None,
    ) -> CompletionLogprobs:
        """The legacy shape of the generated tokens' ``logprobs``, after the echoed prompt's
        (``prompt``: every prompt token, all shown; the first one is None: it keeps its place
        with null values, as token ``first_prompt_id``)."""
        entries = [*prompt, *self._shown(logprobs)]
        ids = tuple(e.token_id if e is not None else (first_prompt_id or 0) for e in entries)
        alternatives = tuple({t for e in entries if e is not None for t, _ in e.top})
        texts = dict(zip(ids, map(_text, self._token_bytes(ids)), strict=True))
        texts.update(zip(alternatives, map(_text, self._token_bytes(alternatives)), strict=True))
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token, entry in zip(ids, entries, strict=True):
            offsets.append(self._offset)
            self._offset += len(self._decoder.decode(self._token_bytes((token,))[0]))
            tokens.append(texts[token])
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            for alternative, logprob in entry.top:
                top.setdefault(texts[alternative], logprob)
            # the chosen token always, as OpenAI's and vLLM's legacy completions answer (up to
            # logprobs + 1 entries; not among the best, it is the least likely of them)
            top.setdefault(texts[token], entry.logprob)
            top_logprobs.append(top)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=token_logprobs,
            top_logprobs=top_logprobs,
            text_offset=offsets,
        )

    def chat(self, logprobs: Sequence[TokenLogprobs]) -> ChatLogprobs:
        """Chat's shape: each token with its bytes and its ``top_logprobs``."""
        entries = [e for e in self._shown(logprobs) if e is not None]
        ids = tuple({e.token_id for e in entries} | {t for e in entries for t, _ in e.top})
        raw = dict(zip(ids, self._token_bytes(ids), strict=True))

        def top(token: int, logprob: float) -> ChatTopLogprob:
            return ChatTopLogprob(token=_text(raw[token]), logprob=logprob, bytes=list(raw[token]))

        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=_text(raw[e.token_id]),
                    logprob=e.logprob,
                    bytes=list(raw[e.token_id]),
                    top_logprobs=[top(t, lp) for t, lp in e.top],
                )
                for e in entries
            ]
        )
