"""Stateless ``next_tokens`` models for the seed's ``generate``, and the loops to check it by.

``one_at_a_time`` is the obvious reference: each request alone, one call per token. The two
call counts are what an ideal loop achieves on the same lengths: continuous batching with FIFO
admission is list scheduling (each request takes the slot that frees first), static batching
runs consecutive groups of ``num_slots`` requests, each as long as its longest member.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Sequence

from app.offline import Request


class HashModel:
    """Deterministic and stateless: the next token is a hash of the whole prefix; it is
    ``stop_token`` one time in ``stop_one_in``. Records a copy of every call's batch."""

    def __init__(self, *, stop_token: int, vocab: int = 50, stop_one_in: int = 4) -> None:
        self.stop_token = stop_token
        self.vocab = vocab
        self.stop_one_in = stop_one_in
        self.calls: list[list[list[int]]] = []

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        self.calls.append([list(prefix) for prefix in batch])
        return [self.next_token(prefix) for prefix in batch]

    def next_token(self, prefix: Sequence[int]) -> int:
        digest = zlib.crc32(repr(list(prefix)).encode())
        if digest % self.stop_one_in == 0:
            return self.stop_token
        return (digest // self.stop_one_in) % self.vocab


class ConstantModel:
    """Never stops: every request runs to its ``max_tokens``. Records every call's batch."""

    def __init__(self, token: int = 7) -> None:
        self.token = token
        self.calls: list[list[list[int]]] = []

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        self.calls.append([list(prefix) for prefix in batch])
        return [self.token] * len(batch)


def one_at_a_time(model: HashModel, requests: Sequence[Request], stop_token: int) -> dict:
    """The obvious loop: each request alone, one ``next_token`` per generated token."""
    outputs: dict[str, list[int]] = {}
    for request in requests:
        generated: list[int] = []
        while len(generated) < request.max_tokens:
            token = model.next_token(request.prompt + generated)
            generated.append(token)
            if token == stop_token:
                break
        outputs[request.request_id] = generated
    return outputs


def continuous_calls(lengths: Sequence[int], num_slots: int) -> int:
    """Model calls of continuous batching with FIFO admission: list scheduling's makespan."""
    free_at = [0] * num_slots
    for length in lengths:
        if length > 0:
            heapq.heappush(free_at, heapq.heappop(free_at) + length)
    return max(free_at)


def static_calls(lengths: Sequence[int], num_slots: int) -> int:
    """Model calls of static batching: consecutive groups of ``num_slots``, each as long as
    its longest member (requests with no tokens to make never join a group)."""
    busy = [length for length in lengths if length > 0]
    return sum(max(busy[i : i + num_slots]) for i in range(0, len(busy), num_slots))
