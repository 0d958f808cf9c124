"""One request's output read as an assistant's answer: reasoning, text and tool calls, in the
order they were generated, in no wire format's terms.

``OutputReader`` takes the output's text as it streams (``feed``) and at its end (``finish``)
and gives ``ReasoningPiece`` / ``TextPiece`` / ``CallPiece`` items; each answer format
(chat completions, responses, messages) turns them into its own fields or events, so that a
streamed answer and a whole one are the same reading (the whole one is ``read_whole``).

Tool calls, by the request's ``ToolPlan``:

* ``auto``: text is passed on until a ``<tool_call>`` tag may begin; from there the rest is
  held and read at the end (complete blocks are calls; an unclosed one, cut by the length
  limit, is dropped, never shown as text). White space before the calls is dropped (kept
  when the tagged text holds no call after all), in a stream as in the whole output.
* ``required``: the output is a JSON array of ``{"name", "arguments"}``; each call is given as
  soon as its array item is complete, so a cut keeps the calls completed before it and drops
  the partial one.
* a named function: the output is the arguments; one call at the end, when they parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.api.openai.tools import ToolCall, ToolMode, ToolPlan
from app.api.reasoning import ReasoningSplitter, partial_tag_length

TOOL_CALL_OPEN = "<tool_call>"


@dataclass(frozen=True, slots=True)
class ReasoningPiece:
    text: str


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class CallPiece:
    """A complete call; ``index`` counts the answer's calls from 0."""

    index: int
    call: ToolCall


OutputPiece = ReasoningPiece | TextPiece | CallPiece


class JsonString:
    """Whether a JSON text read a character at a time is inside a string, escapes followed
    (so brackets and quotes inside strings do not count)."""

    __slots__ = ("inside", "_escaped")

    def __init__(self) -> None:
        self.inside = False
        self._escaped = False

    def closed_by(self, char: str) -> bool:
        """Inside a string: whether ``char`` is its closing quote (then it is no longer inside)."""
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self.inside = False
            return True
        return False


class JsonArrayItems:
    """The items of a JSON array whose text arrives in pieces: each item's text once it is
    complete (strings and escapes followed, so brackets inside strings do not count)."""

    def __init__(self) -> None:
        self._depth = 0
        self._string = JsonString()
        self._item: list[str] = []

    def feed(self, text: str) -> list[str]:
        """The texts of the items completed by ``text``."""
        done: list[str] = []
        for char in text:
            if self._depth >= 2 or (self._depth == 1 and char not in " \t\r\n,]"):
                self._item.append(char)
            if self._string.inside:
                if self._string.closed_by(char):
                    self._item_done_at_top(done)
                continue
            if char == '"':
                self._string.inside = True
            elif char in "[{":
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                self._item_done_at_top(done)
            elif self._depth == 1 and char in " \t\r\n,]":
                self._item_done_at_top(done, scalar_end=True)
        return done

    def _item_done_at_top(self, done: list[str], *, scalar_end: bool = False) -> None:
        if self._depth != 1 or self._string.inside or not self._item:
            return
        closing = self._item[-1]
        if scalar_end or closing in ']}"':
            done.append("".join(self._item))
            self._item.clear()


@dataclass(frozen=True, slots=True)
class CallHead:
    """A ``required`` call whose name has been generated: its index, id and name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsPiece:
    """More of the arguments' JSON text of call ``index``, as generated."""

    index: int
    text: str


class RequiredCallStream:
    """A ``required`` answer (a JSON array of ``{"name", "arguments"}``) read while it streams:
    each call's head once its name is generated, then its arguments' text in pieces as they
    come, so a client sees a call being made (API.md: "the name first, then pieces of
    arguments"). Strings and escapes are followed, so brackets inside them do not count. Ids
    are ``<prefix><index>``, as ``OutputReader`` gives them. Arguments generated before the
    name wait for it."""

    def __init__(self, call_id_prefix: str) -> None:
        self._prefix = call_id_prefix
        self._depth = 0
        self._quoted = JsonString()
        self._index = -1
        self._key: str | None = None  # the item's key whose value comes (None: a key comes)
        self._string: list[str] = []  # the key, or the name, being read
        self._capturing = False  # inside the arguments' value
        self._named = False
        self._waiting = ""  # arguments text before the name

    def feed(self, text: str) -> list[CallHead | ArgumentsPiece]:
        """The heads and argument pieces ``text`` decides."""
        out: list[CallHead | ArgumentsPiece] = []
        piece: list[str] = []
        for char in text:
            if self._capturing:
                piece.append(char)
            if self._quoted.inside:
                self._string_char(char, out)
                continue
            if char == '"':
                self._quoted.inside = True
                self._string.clear()
            elif char in "[{":
                self._depth += 1
                if self._depth == 2:  # an item begins
                    self._index += 1
                    self._key, self._named, self._waiting = None, False, ""
                elif self._depth == 3 and self._key == "arguments" and not self._capturing:
                    self._capturing = True
                    piece.append(char)
            elif char in "]}":
                self._depth -= 1
                if self._capturing and self._depth == 2:  # the arguments' value ended
                    self._capturing = False
                    self._flush(piece, out)
                elif self._capturing and self._depth < 2:  # ended with the item: drop '}'
                    piece.pop()
                    self._capturing = False
                    self._flush(piece, out)
            elif self._depth == 2 and not self._capturing:
                if char == ":":
                    pass
                elif char == ",":
                    self._key = None
                elif not char.isspace() and self._key == "arguments":  # a scalar value
                    self._capturing = True
                    piece.append(char)
            elif self._capturing and self._depth == 2 and (char == "," or char.isspace()):
                piece.pop()  # a scalar value ended
                self._capturing = False
                self._flush(piece, out)
                if char == ",":
                    self._key = None
        self._flush(piece, out)
        return out

    def _string_char(self, char: str, out: list[CallHead | ArgumentsPiece]) -> None:
        if self._quoted.closed_by(char):
            if self._depth == 2 and not self._capturing:
                if self._key is None:
                    self._key = "".join(self._string)
                    return
                if self._key == "name" and not self._named:
                    self._named = True
                    name = json.loads('"' + "".join(self._string) + '"')
                    out.append(CallHead(self._index, f"{self._prefix}{self._index}", name))
                    if self._waiting:
                        out.append(ArgumentsPiece(self._index, self._waiting))
                        self._waiting = ""
            return
        if self._depth == 2 and not self._capturing:
            self._string.append(char)

    def _flush(self, piece: list[str], out: list[CallHead | ArgumentsPiece]) -> None:
        if not piece:
            return
        text = "".join(piece)
        piece.clear()
        if self._named:
            out.append(ArgumentsPiece(self._index, text))
        else:
            self._waiting += text


class OutputReader:
    """Reads one output (see the module doc). Not shared: one per request and choice.

    Args:
        tools: the request's tool plan, or None without tools.
        reasoning: the request's reasoning splitter, or None when its output is all content.
        call_id_prefix: calls are given ids ``<prefix>0``, ``<prefix>1``...
    """

    def __init__(
        self,
        tools: ToolPlan | None,
        reasoning: ReasoningSplitter | None,
        call_id_prefix: str,
    ) -> None:
        self._plan = tools
        self._reasoning = reasoning
        self._prefix = call_id_prefix
        self._mode = ToolMode.NONE if tools is None else tools.mode
        self._calls = 0
        self._held = ""  # auto: text that may begin a call; named: the arguments
        self._in_calls = False  # auto: a <tool_call> tag was seen
        self._space_before_calls = ""  # auto: the white space before that tag
        self._items = JsonArrayItems()

    @property
    def calls_made(self) -> int:
        """How many calls this reader has given so far."""
        return self._calls

    def fresh(self) -> OutputReader:
        """A reader that starts as this one did (``read_whole``)."""
        reasoning = None if self._reasoning is None else self._reasoning.fresh()
        return OutputReader(self._plan, reasoning, self._prefix)

    def feed(self, text: str) -> list[OutputPiece]:
        """The pieces decided by ``text`` (more of the output)."""
        if self._reasoning is None:
            return self._content(text)
        split = self._reasoning.feed(text)
        pieces: list[OutputPiece] = [ReasoningPiece(split.reasoning)] if split.reasoning else []
        return pieces + self._content(split.content)

    def finish(self) -> list[OutputPiece]:
        """The pieces left at the end of the output."""
        pieces: list[OutputPiece] = []
        if self._reasoning is not None:
            split = self._reasoning.finish()
            if split.reasoning:
                pieces.append(ReasoningPiece(split.reasoning))
            pieces += self._content(split.content)
        return pieces + self._content_end()

    def read_whole(self, text: str) -> list[OutputPiece]:
        """A whole output's pieces, read as a stream of it would be, pieces of a kind joined."""
        reader = self.fresh()
        return merged(reader.feed(text) + reader.finish())

    # ----------------------------------------------------------------- content

    def _content(self, text: str) -> list[OutputPiece]:
        if not text:
            return []
        if self._mode is ToolMode.REQUIRED:
            calls = (self._call_of_item(item) for item in self._items.feed(text))
            return [call for call in calls if call is not None]
        if self._mode is ToolMode.NAMED or self._in_calls:
            self._held += text
            return []
        if self._mode is ToolMode.AUTO:
            return self._auto_text(text)
        return [TextPiece(text)]

    def _auto_text(self, text: str) -> list[OutputPiece]:
        """Text up to a possible tag and the white space before it (held: dropped before
        calls), so that every split of the output gives the pieces the whole does."""
        held = self._held + text
        start = held.find(TOOL_CALL_OPEN)
        if start >= 0:
            self._in_calls = True
            self._held = held[start:]
            emit, self._space_before_calls = _split_trailing_space(held[:start])
            return [TextPiece(emit)] if emit else []
        emit, trailing = _split_trailing_space(held)
        keep = partial_tag_length(emit, TOOL_CALL_OPEN)
        if keep:  # the space before a partial tag is held with it
            emit, space = _split_trailing_space(emit[: len(emit) - keep])
            trailing = space + held[len(emit) + len(space) :]
        self._held = trailing
        return [TextPiece(emit)] if emit else []

    def _content_end(self) -> list[OutputPiece]:
        held, self._held = self._held, ""
        if self._mode is ToolMode.NAMED:
            try:
                json.loads(held)
            except ValueError:
                return []  # cut short: a partial call is dropped
            return [self._piece(self._plan.named or "", held)]  # type: ignore[union-attr]
        if self._mode is ToolMode.AUTO and self._in_calls:
            assert self._plan is not None
            calls, rest = self._plan.read_calls(held, self._prefix)
            rest_text = _without_open_call(rest or "") if calls else _without_open_call(held)
            if rest_text and not calls:  # no call after all: the text keeps its space
                rest_text = self._space_before_calls + rest_text
            pieces: list[OutputPiece] = [TextPiece(rest_text)] if rest_text else []
            for call in calls:
                pieces.append(self._piece(call.name, call.arguments))
            return pieces
        return [TextPiece(held)] if held else []

    def _call_of_item(self, item: str) -> CallPiece | None:
        try:
            value = json.loads(item)
            name, arguments = value["name"], value["arguments"]
        except (ValueError, TypeError, KeyError):  # not a call: the constraint rules it out
            return None
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return self._piece(name, arguments)

    def _piece(self, name: str, arguments: str) -> CallPiece:
        piece = CallPiece(self._calls, ToolCall(f"{self._prefix}{self._calls}", name, arguments))
        self._calls += 1
        return piece


def merged(pieces: list[OutputPiece]) -> list[OutputPiece]:
    """Adjacent reasoning or text pieces joined (empty ones dropped); calls kept as they are."""
    out: list[OutputPiece] = []
    for piece in pieces:
        if isinstance(piece, TextPiece | ReasoningPiece) and not piece.text:
            continue
        last = out[-1] if out else None
        if isinstance(piece, TextPiece) and isinstance(last, TextPiece):
            out[-1] = TextPiece(last.text + piece.text)
        elif isinstance(piece, ReasoningPiece) and isinstance(last, ReasoningPiece):
            out[-1] = ReasoningPiece(last.text + piece.text)
        else:
            out.append(piece)
    return out


def _split_trailing_space(text: str) -> tuple[str, str]:
    stripped = text.rstrip()
    return stripped, text[len(stripped) :]


def _without_open_call(text: str) -> str:
    """Text without an unclosed ``<tool_call>`` block (a call cut short) and the space around."""
    start = text.rfind(TOOL_CALL_OPEN)
    if start >= 0 and "</tool_call>" not in text[start:]:
        text = text[:start]
    return text.strip()
