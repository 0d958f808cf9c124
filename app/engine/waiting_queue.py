"""The scheduler's waiting queue: sequences not yet in a slot, first in, first out.

It is the one owner of the prompt tokens waiting (what admission limits read): the sum changes
only in the three ways a sequence enters or leaves the queue, so it cannot drift from it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from app.engine.request import Sequence


class WaitingQueue:
    """FIFO of waiting sequences with the sum of their prompt tokens.

    Attributes (read-only):
        prompt_tokens: prompt tokens of every sequence in the queue.
    """

    def __init__(self) -> None:
        self._sequences: deque[Sequence] = deque()
        self.prompt_tokens = 0

    def __len__(self) -> int:
        return len(self._sequences)

    def __bool__(self) -> bool:
        return bool(self._sequences)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._sequences)

    def __contains__(self, seq: object) -> bool:
        return seq in self._sequences

    def append(self, seq: Sequence) -> None:
        self._sequences.append(seq)
        self.prompt_tokens += seq.num_prompt_tokens

    def appendleft(self, seq: Sequence) -> None:
        """Puts ``seq`` at the head (a preempted sequence goes first when blocks free up)."""
        self._sequences.appendleft(seq)
        self.prompt_tokens += seq.num_prompt_tokens

    def popleft(self) -> Sequence:
        """The oldest sequence, removed. Raises IndexError when the queue is empty."""
        seq = self._sequences.popleft()
        self.prompt_tokens -= seq.num_prompt_tokens
        return seq

    def remove(self, seq: Sequence) -> None:
        """Removes ``seq`` (cancelled while waiting). Raises ValueError when it is not here."""
        self._sequences.remove(seq)
        self.prompt_tokens -= seq.num_prompt_tokens
