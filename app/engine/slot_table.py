"""The batch slots: which sequence holds each of the model's ``max_num_seqs`` slots.

The scheduler is the only caller that changes it (admission takes a slot; ``finish`` and
preemption free one, through the scheduler's ``_release``); everything else reads it.
"""

from __future__ import annotations

from collections.abc import Iterator

from app.engine.request import Sequence


class SlotTable:
    """Slot index -> the sequence holding it, and how many are held.

    Args:
        num_slots: the model's ``max_num_seqs``.
    """

    __slots__ = ("_slots", "_num_running")

    def __init__(self, num_slots: int) -> None:
        self._slots: list[Sequence | None] = [None] * num_slots
        self._num_running = 0  # held slots, kept with every take and free

    def __len__(self) -> int:
        """The number of slots, held or free."""
        return len(self._slots)

    def __iter__(self) -> Iterator[Sequence]:
        """The sequences holding a slot, in slot order (a snapshot: slots may change while
        it is iterated)."""
        return iter([seq for seq in self._slots if seq is not None])

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_free(self) -> int:
        return len(self._slots) - self._num_running

    def free_slots(self) -> list[int]:
        """The indexes of the free slots, ascending."""
        return [index for index, seq in enumerate(self._slots) if seq is None]

    def holds(self, slot: int, seq: Sequence) -> bool:
        """Whether ``slot`` holds this very sequence (identity, rule R17)."""
        return self._slots[slot] is seq

    def take(self, slot: int, seq: Sequence) -> None:
        """``seq`` enters free ``slot``.

        Raises:
            ValueError: the slot is held.
        """
        if self._slots[slot] is not None:
            raise ValueError(f"slot {slot} is held")
        self._slots[slot] = seq
        self._num_running += 1

    def free(self, slot: int) -> None:
        """Frees held ``slot`` (a no-op for a free one)."""
        if self._slots[slot] is not None:
            self._slots[slot] = None
            self._num_running -= 1
