"""The loop's cheaper row construction is the same rows and the same mock tokens.

``plain_decode_row`` sets ``StepRow``'s slots directly, ``pending_row`` keeps step N's block
table when the table did not grow, and the mock hashes its tails with ``bytes`` where it can:
each must give exactly what the plain construction gives.
"""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest

from app.engine.kv_blocks import BlockManager
from app.engine.lookahead import PENDING_TOKEN, pending_row
from app.engine.request import GenerationRequest, Sequence, StopCriteria
from app.engine.step_rows import plain_decode_row
from app.models.base import KVBlocks, SamplingParams, StepRow
from app.models.mock import MOCK_EOS_TOKEN_ID, MockModel, _low_bytes
from tests.engine.conftest import make_sequence


@pytest.mark.parametrize(
    ("slot", "tokens", "position", "blocks"),
    [(0, (7,), 0, None), (3, (PENDING_TOKEN,), 41, KVBlocks((1, 2, 3))), (9, (256,), 5, None)],
)
def test_a_plain_decode_row_equals_the_dataclass_row(slot, tokens, position, blocks) -> None:
    sampling = SamplingParams(temperature=0.7, seed=11)
    fast = plain_decode_row(slot, tokens, position, sampling, blocks)
    slow = StepRow(slot, tokens, position, True, sampling, kv_blocks=blocks)
    assert fast == slow
    for name in (f.name for f in dataclasses.fields(StepRow)):
        assert getattr(fast, name) == getattr(slow, name), name
    assert hash(fast) == hash(slow)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.position = 1  # type: ignore[misc]


def _decoding_sequence(kv: BlockManager, num_tokens: int) -> Sequence:
    request = GenerationRequest(
        request_id="r",
        prompt_token_ids=tuple(range(1, num_tokens + 1)),
        max_tokens=64,
        sampling=SamplingParams(),
        stop=StopCriteria(),
    )
    seq, _ = make_sequence(request)
    seq.slot = 2
    assert kv.allocate(seq, request.prompt_token_ids, b"", num_tokens=num_tokens) == 0
    return seq


def test_a_pending_row_keeps_the_previous_table_only_while_it_is_the_same() -> None:
    kv = BlockManager(num_blocks=32, block_size=4)
    seq = _decoding_sequence(kv, 6)  # two blocks
    previous = KVBlocks(kv.table(seq))
    same = pending_row(seq, 6, kv, previous)
    assert same.kv_blocks is previous
    assert same == StepRow(2, (PENDING_TOKEN,), 6, True, seq.request.sampling, kv_blocks=previous)

    starting = KVBlocks(kv.table(seq), starts_sequence=True, prefix_token_ids=(1, 2))
    fresh = pending_row(seq, 6, kv, starting)  # the row after a sequence's first: no flag
    assert fresh.kv_blocks == KVBlocks(kv.table(seq)) and not fresh.kv_blocks.starts_sequence

    assert kv.grow(seq, 9)  # a third block: the table grew
    grown = pending_row(seq, 8, kv, previous)
    assert grown.kv_blocks == KVBlocks(kv.table(seq)) and len(grown.kv_blocks.block_ids) == 3
    assert pending_row(seq, 8, None, previous).kv_blocks is None


def test_the_mock_hashes_the_low_byte_of_every_token() -> None:
    generator = random.Random(3)
    tails = [[], [0, 255], [MOCK_EOS_TOKEN_ID], [-1, 300, 5], list(range(256))]
    tails += [[generator.choice([*range(256), 256, -1]) for _ in range(32)] for _ in range(200)]
    for tail in tails:
        assert _low_bytes(tail) == bytes(token & 0xFF for token in tail)


def test_the_mock_tokens_are_the_seeds_definition() -> None:
    """The next token from the CRC-32 of the length and the last 32 tokens' low bytes, EOS
    1 time in ``eos_one_in``: recomputed here from the definition, over prefixes with EOS."""
    alphabet = tuple(ch.encode() for ch in "abcdefghijklmnopqrstuvwxyz      .,éß中文😀")
    generator = random.Random(5)
    model = MockModel(eos_one_in=24)
    prefixes = [[*b"hello ", MOCK_EOS_TOKEN_ID, *b"abc"]]
    prefixes += [[generator.choice(b"ab .,") for _ in range(n)] for n in range(1, 60)]
    prefixes += [[*prefix, MOCK_EOS_TOKEN_ID, ord("x")] for prefix in prefixes[1:20]]
    for prefix in prefixes:
        digest = zlib.crc32(bytes(t & 0xFF for t in prefix[-32:]), len(prefix))
        expected = (
            MOCK_EOS_TOKEN_ID if digest % 24 == 0 else alphabet[(digest // 24) % len(alphabet)][0]
        )
        assert model.next_tokens([prefix]) == [expected]


@pytest.mark.parametrize("order", [0, 2, 40])
def test_the_mock_token_at_a_position_is_its_prefix_s(order: int) -> None:
    """``next_token_at(tokens, end)``, which prompt logprobs and draft verification call at
    every position (it reads the tail, not a copy of the prefix: those were O(n^2) in the
    prompt's length), equals ``next_tokens`` of the copied prefix, inside UTF-8 characters
    and past EOS too."""
    generator = random.Random(order)
    model = MockModel(eos_one_in=7, order=order)
    tokens = [*"añ中😀 x".encode(), MOCK_EOS_TOKEN_ID]
    tokens += [
        generator.choice([*b"ab .", 0xC3, 0xA9, 0xE4, MOCK_EOS_TOKEN_ID]) for _ in range(200)
    ]
    for end in range(len(tokens) + 1):
        assert model.next_token_at(tokens, end) == model.next_tokens([tokens[:end]])[0], end
