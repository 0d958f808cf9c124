"""Admission policies: how many waiting sequences may enter free slots before a step.

The scheduler owns the mechanism (queues, slots); a policy only answers how many to admit, from
read-only counts. Swapping the policy object switches scheduling behaviour with no branch in the
loop.
"""

from __future__ import annotations

from typing import Protocol


class AdmissionPolicy(Protocol):
    name: str

    def admit_count(self, *, free_slots: int, running: int, waiting: int) -> int:
        """Number of waiting sequences to admit now, ``0 <= n <= min(free_slots, waiting)``."""
        ...


class ContinuousBatching:
    """Refill every free slot before each step (Orca-style iteration-level scheduling,
    Yu et al., OSDI 2022)."""

    name = "continuous"

    def admit_count(self, *, free_slots: int, running: int, waiting: int) -> int:
        return min(free_slots, waiting)


class StaticBatching:
    """Admit a new batch only when every slot is empty; the baseline continuous batching beats."""

    name = "static"

    def admit_count(self, *, free_slots: int, running: int, waiting: int) -> int:
        if running > 0:
            return 0
        return min(free_slots, waiting)


def make_policy(name: str) -> AdmissionPolicy:
    """Raises ValueError for an unknown policy name."""
    policies: dict[str, type[ContinuousBatching] | type[StaticBatching]] = {
        "continuous": ContinuousBatching,
        "static": StaticBatching,
    }
    try:
        return policies[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}") from None
