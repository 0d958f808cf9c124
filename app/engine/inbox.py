"""The engine's inbox: frozen commands from any task to the loop task, which alone applies them.

A ``Submit`` in the inbox is a request that waits like a queued one: admission limits count it.
``Inbox`` is the one owner of those counts; they change only when a command is put or taken, so
they cannot drift from what the queue holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

from app.engine.handle import RequestHandle
from app.engine.request import GenerationRequest


@dataclass(frozen=True, slots=True)
class Submit:
    """Start the request behind ``handle``."""

    handle: RequestHandle


@dataclass(frozen=True, slots=True)
class Cancel:
    """Cancel the request *object* (not its id: ids can be reused, rule R17).

    Attributes:
        request: the request to cancel.
        issued_at: ``time.perf_counter()`` seconds when the cancel was asked for.
    """

    request: GenerationRequest
    issued_at: float


Command = Submit | Cancel


class Inbox:
    """An unbounded FIFO of commands; ``put`` never blocks (callable from any task of the loop).

    Attributes (read-only):
        num_submits: ``Submit`` commands in the inbox.
        submitted_prompt_tokens: prompt tokens of those submits.
    """

    def __init__(self) -> None:
        self._commands: asyncio.Queue[Command] = asyncio.Queue()
        self.num_submits = 0
        self.submitted_prompt_tokens = 0

    def put(self, command: Command) -> None:
        if isinstance(command, Submit):
            self.num_submits += 1
            self.submitted_prompt_tokens += len(command.handle.request.prompt_token_ids)
        self._commands.put_nowait(command)

    async def get(self) -> Command:
        """Waits for the next command."""
        return self._taken(await self._commands.get())

    def take_ready(self) -> Iterator[Command]:
        """Every command in the inbox now, in order, without waiting; each leaves the inbox as
        it is yielded (a command put meanwhile is yielded too)."""
        while not self._commands.empty():
            yield self._taken(self._commands.get_nowait())

    def _taken(self, command: Command) -> Command:
        if isinstance(command, Submit):
            self.num_submits -= 1
            self.submitted_prompt_tokens -= len(command.handle.request.prompt_token_ids)
        return command
