"""Reasoning content: the text a reasoning model writes between ``<think>`` and ``</think>``,
answered apart from the content (``reasoning_content`` on /v1/chat/completions, a ``reasoning``
item on /v1/responses, a ``thinking`` block on /v1/messages).

``ReasoningParser`` is the server's setting (``--reasoning-parser``): ``auto`` turns it on when
the chat template opens a ``<think>`` block, ``think`` always, ``none`` never. For one request,
``ReasoningParser.start`` reads the end of the rendered prompt: a prompt that ends with an
open ``<think>`` (a template that opened the block itself after the assistant's header:
DeepSeek-R1 distills, Qwen3 with thinking forced) makes the output begin inside it. A
``<think>`` earlier in the tail is not the template's (a user's message ending with the tag is
followed by the end of its turn and the assistant's header). Otherwise the output is content
unless it begins (after white space) with ``<think>`` (Qwen3's default). ``ReasoningSplitter``
then splits the output as it streams: a tag cut across tokens is held back until it is
decided, and an unclosed block at the end (a length cut) is all reasoning. A constrained
request (a required or named tool call, a response format) has no reasoning: its output is the
constrained language from the first token.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# The end of a prompt read for an opened block: a template writes "<think>\n" after the
# assistant's header, a few tokens at most.
PROMPT_TAIL_TOKENS = 16


class ReasoningSetting(enum.Enum):
    """``--reasoning-parser``: ``auto`` (on when the template opens ``<think>``), ``think``
    (always on), ``none`` (off)."""

    AUTO = "auto"
    THINK = "think"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """Whether this server splits reasoning out of answers (decided once, at start-up).

    Attributes:
        enabled: the ``<think>`` parser is on.
    """

    enabled: bool

    @classmethod
    def of(cls, setting: str, template_source: str) -> ReasoningParser:
        """The parser for ``--reasoning-parser`` ``setting`` and the chat template in use.

        Raises:
            ValueError: an unknown setting.
        """
        mode = ReasoningSetting(setting)
        if mode is ReasoningSetting.AUTO:
            return cls(THINK_OPEN in template_source)
        return cls(mode is ReasoningSetting.THINK)

    def for_prompt(
        self,
        prompt_token_ids: tuple[int, ...],
        decode: Callable[[tuple[int, ...]], str],
        *,
        constrained: bool,
    ) -> ReasoningSplitter | None:
        """``start`` for a request's prompt: its last ``PROMPT_TAIL_TOKENS`` tokens decoded
        (``decode``: the engine's) tell whether the template opened the block."""
        if not self.enabled or constrained:
            return None
        return self.start(decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:]), constrained=False)

    def start(self, prompt_tail: str, *, constrained: bool) -> ReasoningSplitter | None:
        """A splitter for one request's output, or None when its output is all content.

        Args:
            prompt_tail: the end of the rendered prompt (a few dozen tokens' text): when it
                ends with ``<think>`` (and white space), the output begins inside the block.
            constrained: the request's output is a constrained language (no reasoning then).
        """
        if not self.enabled or constrained:
            return None
        return ReasoningSplitter(inside=prompt_tail.rstrip().endswith(THINK_OPEN))


class _Phase(enum.Enum):
    BEFORE = enum.auto()  # nothing decided yet: the output may still open a block
    INSIDE = enum.auto()  # in the block: reasoning
    AFTER_CLOSE = enum.auto()  # just closed: white space before the content is dropped
    CONTENT = enum.auto()  # content for the rest of the output


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """New output split in two: ``reasoning`` and ``content`` (either may be "")."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Splits one output into reasoning and content as its text arrives (see the module doc).

    Not shared: one per request (and per choice). Feeding the whole text at once and then
    ``finish()`` gives the same split as feeding it in any pieces.

    Args:
        inside: the output begins inside a ``<think>`` block (the template opened it).
    """

    def __init__(self, *, inside: bool) -> None:
        self._inside_at_start = inside
        self._phase = _Phase.INSIDE if inside else _Phase.BEFORE
        self._held = ""

    def fresh(self) -> ReasoningSplitter:
        """A new splitter that starts as this one did (to split a whole answer)."""
        return ReasoningSplitter(inside=self._inside_at_start)

    def feed(self, text: str) -> ReasoningSplit:
        """The reasoning and content decided by ``text`` (more output), holding back what
        could still be part of a tag."""
        self._held += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._held:
            before = (self._phase, len(self._held))
            self._advance(reasoning, content)
            if (self._phase, len(self._held)) == before:
                break  # waiting for more text
        return ReasoningSplit("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningSplit:
        """What was held back, at the end of the output: an unclosed block is reasoning."""
        held, self._held = self._held, ""
        if self._phase is _Phase.INSIDE:
            return ReasoningSplit(reasoning=held)
        if self._phase is _Phase.AFTER_CLOSE:
            return ReasoningSplit()
        return ReasoningSplit(content=held)

    def _advance(self, reasoning: list[str], content: list[str]) -> None:
        held = self._held
        if self._phase is _Phase.BEFORE:
            stripped = held.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._phase = _Phase.INSIDE
                self._held = stripped[len(THINK_OPEN) :]
            elif not THINK_OPEN.startswith(stripped):  # "" and "<thi" wait for more
                self._phase = _Phase.CONTENT
        elif self._phase is _Phase.INSIDE:
            end = held.find(THINK_CLOSE)
            if end >= 0:
                reasoning.append(held[:end])
                self._held = held[end + len(THINK_CLOSE) :]
                self._phase = _Phase.AFTER_CLOSE
            else:
                keep = partial_tag_length(held, THINK_CLOSE)
                reasoning.append(held[: len(held) - keep])
                self._held = held[len(held) - keep :]
        elif self._phase is _Phase.AFTER_CLOSE:
            stripped = held.lstrip()
            self._held = stripped
            if stripped:
                self._phase = _Phase.CONTENT
        else:
            content.append(held)
            self._held = ""


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
