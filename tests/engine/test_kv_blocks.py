"""The block manager alone, without a model: allocation, reference counts, the hash chain, the
LRU of cached blocks, preemption and resume, cancel in every state, owner identity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.engine.kv_blocks import BlockManager
from app.engine.kv_hash_chain import SALT_ANY, SALT_EXACT, chain_hashes
from app.models.base import NULL_BLOCK

BS = 4


class Owner:
    """A stand-in for a scheduler Sequence: hashed by identity."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Owner({self.name})"


def manager(num_blocks: int = 9, *, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=BS, prefix_caching=caching)


def test_allocate_and_free_count_blocks_and_never_hand_out_the_null_block() -> None:
    kv = manager(9)
    a = Owner("a")
    assert kv.allocate(a, list(range(10)), SALT_ANY, num_tokens=10) == 0
    assert len(kv.table(a)) == 3 and NULL_BLOCK not in kv.table(a)
    assert kv.num_used_blocks == 3 and kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(a)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 8
    kv.check()


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = manager(4)  # 3 usable
    a, b = Owner("a"), Owner("b")
    assert kv.allocate(a, list(range(8)), SALT_ANY, num_tokens=8) == 0
    assert kv.allocate(b, list(range(100, 108)), SALT_ANY, num_tokens=8) is None
    assert not kv.holds(b) and kv.num_used_blocks == 2
    kv.check()


def test_grow_adds_a_block_at_each_boundary_and_refuses_when_full() -> None:
    kv = manager(3)  # 2 usable
    a = Owner("a")
    kv.allocate(a, [1, 2, 3], SALT_ANY, num_tokens=3)
    assert kv.grow(a, 4) and len(kv.table(a)) == 1
    assert kv.grow(a, 5) and len(kv.table(a)) == 2
    assert not kv.grow(a, 9) and len(kv.table(a)) == 2
    kv.check()


def test_prefix_hit_after_the_owner_finished() -> None:
    kv = manager(9)
    prompt = list(range(10))
    a = Owner("a")
    kv.allocate(a, prompt, SALT_ANY, num_tokens=10)
    kv.commit(a, prompt, 10)  # two full blocks registered, the partial third not
    first_two = kv.table(a)[:2]
    kv.free(a)
    b = Owner("b")
    assert kv.allocate(b, prompt + [99], SALT_ANY, num_tokens=11) == 8
    assert kv.table(b)[:2] == first_two
    kv.check()


def test_uncommitted_blocks_are_never_hit() -> None:
    """A cancel mid-prefill: blocks written by a step whose output was dropped stay unhashed."""
    kv = manager(9)
    prompt = list(range(12))
    a = Owner("a")
    kv.allocate(a, prompt, SALT_ANY, num_tokens=12)
    kv.free(a)  # cancelled before any commit
    b = Owner("b")
    assert kv.allocate(b, prompt, SALT_ANY, num_tokens=12) == 0
    kv.check()


def test_a_hit_leaves_the_last_token_to_compute() -> None:
    kv = manager(9)
    prompt = list(range(8))  # exactly two blocks
    a = Owner("a")
    kv.allocate(a, prompt, SALT_ANY, num_tokens=8)
    kv.commit(a, prompt, 8)
    kv.free(a)
    assert kv.allocate(Owner("b"), prompt, SALT_ANY, num_tokens=8) == 4  # not 8
    kv.check()


def test_shared_prefix_is_reference_counted() -> None:
    kv = manager(9)
    prompt = list(range(9))
    a, b = Owner("a"), Owner("b")
    kv.allocate(a, prompt, SALT_ANY, num_tokens=9)
    kv.commit(a, prompt, 9)
    assert kv.allocate(b, prompt[:8] + [50], SALT_ANY, num_tokens=9) == 8
    shared = kv.table(a)[:2]
    assert kv.table(b)[:2] == shared
    assert [kv.ref_count(block) for block in shared] == [2, 2]
    kv.free(a)
    assert [kv.ref_count(block) for block in shared] == [1, 1]
    kv.check()


def test_hash_chain_covers_the_whole_prefix() -> None:
    """Equal second blocks after different first blocks are different prefixes."""
    one = chain_hashes([1, 2, 3, 4, 9, 9, 9, 9], BS, SALT_ANY)
    two = chain_hashes([5, 6, 7, 8, 9, 9, 9, 9], BS, SALT_ANY)
    assert one[1] != two[1]
    assert chain_hashes([1, 2, 3, 4, 9, 9, 9, 9], BS, SALT_EXACT)[0] != one[0]
    grown = chain_hashes([1, 2, 3, 4], BS, SALT_ANY)
    assert chain_hashes([1, 2, 3, 4, 9, 9, 9, 9], BS, SALT_ANY, grown) == one


def test_salts_never_share_blocks() -> None:
    kv = manager(9)
    prompt = list(range(9))
    a = Owner("a")
    kv.allocate(a, prompt, SALT_ANY, num_tokens=9)
    kv.commit(a, prompt, 9)
    kv.free(a)
    assert kv.allocate(Owner("seeded"), prompt, SALT_EXACT, num_tokens=9) == 0


def test_eviction_takes_uncached_blocks_first_then_least_recently_freed() -> None:
    kv = manager(5)  # 4 usable
    old, new = Owner("old"), Owner("new")
    old_prompt, new_prompt = list(range(5)), list(range(100, 105))
    kv.allocate(old, old_prompt, SALT_ANY, num_tokens=5)
    kv.commit(old, old_prompt, 5)
    kv.free(old)
    kv.allocate(new, new_prompt, SALT_ANY, num_tokens=5)
    kv.commit(new, new_prompt, 5)
    kv.free(new)
    assert kv.num_cached_blocks == 2
    # One block: an uncached one goes first, both prefixes stay.
    kv.allocate(Owner("x"), [7], SALT_ANY, num_tokens=1)
    assert kv.num_cached_blocks == 2
    # Two more: the next uncached one, then old's cached block (freed before new's).
    kv.allocate(Owner("y"), [8, 8, 8, 8, 8], SALT_ANY, num_tokens=5)
    assert kv.num_cached_blocks == 1
    assert kv.allocate(Owner("z"), old_prompt, SALT_ANY, num_tokens=5) is None  # pool full
    kv.check()


def test_a_finished_sequence_frees_its_deepest_block_first() -> None:
    kv = manager(4)  # 3 usable
    a = Owner("a")
    prompt = list(range(13))
    kv.allocate(a, prompt[:12], SALT_ANY, num_tokens=12)
    kv.commit(a, prompt, 12)
    kv.free(a)
    x = Owner("x")
    kv.allocate(x, [1], SALT_ANY, num_tokens=1)  # evicts block 3 of a's prefix
    assert kv.num_cached_blocks == 2
    kv.free(x)
    c = Owner("c")
    assert kv.allocate(c, prompt[:9], SALT_ANY, num_tokens=9) == 8  # the head survived
    kv.check()


def test_preemption_and_resume_reuse_the_committed_blocks() -> None:
    kv = manager(9)
    a = Owner("a")
    tokens = list(range(6))
    kv.allocate(a, tokens, SALT_ANY, num_tokens=6)
    kv.commit(a, tokens, 6)
    tokens += [40, 41, 42]  # generated while decoding
    assert kv.grow(a, 9)
    kv.commit(a, tokens, 8)  # the last sampled token is not computed yet
    kv.free(a)  # preempted
    assert kv.allocate(a, tokens, SALT_ANY, num_tokens=8) == 4  # resumes; last block recomputed
    kv.check()


def test_cancel_in_every_state_frees_everything() -> None:
    kv = manager(9)
    waiting = Owner("waiting")
    kv.cached_prefix(waiting, list(range(9)), SALT_ANY)  # hashed while it waited
    kv.free(waiting)
    prefilling = Owner("prefilling")
    kv.allocate(prefilling, list(range(9)), SALT_ANY, num_tokens=9)
    kv.free(prefilling)
    decoding = Owner("decoding")
    kv.allocate(decoding, list(range(3)), SALT_ANY, num_tokens=3)
    kv.commit(decoding, list(range(3)), 3)
    kv.grow(decoding, 4)
    kv.free(decoding)
    kv.free(decoding)  # twice: a no-op
    assert kv.num_used_blocks == 0 and not kv._hashes and not kv._pending
    kv.check()


def test_request_id_reuse_is_a_different_owner() -> None:
    kv = manager(9)
    first, second = Owner("req-1"), Owner("req-1")
    kv.allocate(first, [1, 2, 3], SALT_ANY, num_tokens=3)
    kv.allocate(second, [1, 2, 3], SALT_ANY, num_tokens=3)
    kv.free(first)
    assert kv.holds(second) and len(kv.table(second)) == 1
    kv.check()


def test_a_prefix_being_computed_is_in_flight_until_committed() -> None:
    kv = manager(9)
    prompt = list(range(9))
    a, b = Owner("a"), Owner("b")
    kv.allocate(a, prompt, SALT_ANY, num_tokens=9)
    assert kv.prefix_in_flight(b, prompt, SALT_ANY, 0)
    kv.commit(a, prompt, 9)
    hit = kv.cached_prefix(b, prompt, SALT_ANY)
    assert len(hit) == 2 and not kv.prefix_in_flight(b, prompt, SALT_ANY, len(hit))
    kv.free(a)
    kv.check()


def test_prefix_caching_off_never_hashes() -> None:
    kv = manager(9, caching=False)
    prompt = list(range(9))
    a = Owner("a")
    kv.allocate(a, prompt, SALT_ANY, num_tokens=9)
    kv.commit(a, prompt, 9)
    kv.free(a)
    assert kv.num_cached_blocks == 0
    assert kv.allocate(Owner("b"), prompt, SALT_ANY, num_tokens=9) == 0
    kv.check()


# A small vocabulary and prompts drawn from a few stems make prefix hits common.
_stems = st.sampled_from([(1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (7,) * 8])
_prompts = st.tuples(_stems, st.lists(st.integers(0, 3), max_size=9)).map(
    lambda parts: list(parts[0][: len(parts[1]) % 9]) + parts[1] or [0]
)
_actions = st.lists(
    st.tuples(st.sampled_from(["submit", "step", "cancel", "finish", "preempt"]), _prompts),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_actions, st.booleans(), st.sampled_from([3, 6, 12]))
def test_random_lifecycles_never_leak_or_share_a_held_block(
    actions: list[tuple[str, list[int]]], caching: bool, num_blocks: int
) -> None:
    """Submit / step (compute a chunk or a token, commit, grow) / cancel / finish / preempt in
    any order: every invariant holds after each action, no block is ever in two tables unless
    both hold the same cached prefix, and freeing everyone leaves no block held."""
    kv = BlockManager(num_blocks=num_blocks, block_size=BS, prefix_caching=caching)
    live: dict[Owner, list[int]] = {}  # owner -> its tokens
    computed: dict[Owner, int] = {}
    for number, (action, prompt) in enumerate(actions):
        if action == "submit":
            owner = Owner(str(number))
            start = kv.allocate(owner, prompt, SALT_ANY, num_tokens=len(prompt))
            if start is not None:
                assert start % BS == 0 and start < len(prompt)
                live[owner], computed[owner] = list(prompt), start
        elif live:
            owner = list(live)[number % len(live)]
            if action == "step":
                tokens = live[owner]
                if computed[owner] < len(tokens):
                    computed[owner] = min(len(tokens), computed[owner] + 5)
                    kv.commit(owner, tokens, computed[owner])
                if computed[owner] == len(tokens):
                    tokens.append(number % 4)  # sampled; its K/V comes with the next step
                    if not kv.grow(owner, len(tokens)):
                        kv.free(owner)  # preempted for lack of blocks
                        del live[owner], computed[owner]
            elif action == "preempt":
                tokens = live[owner]
                kv.free(owner)
                start = kv.allocate(owner, tokens, SALT_ANY, num_tokens=len(tokens))
                if start is None:
                    del live[owner], computed[owner]
                else:
                    computed[owner] = start
            else:  # cancel or finish: the same funnel
                kv.free(owner)
                del live[owner], computed[owner]
        kv.check()
        for owner, tokens in live.items():
            table = kv.table(owner)
            assert len(table) == kv.blocks_for(len(tokens))
            for other, other_tokens in live.items():
                if other is owner:
                    continue
                for index, block in enumerate(kv.table(other)):
                    if block in table:  # shared: the same full prefix, cached
                        assert table.index(block) == index
                        assert tokens[: (index + 1) * BS] == other_tokens[: (index + 1) * BS]
    for owner in list(live):
        kv.free(owner)
    assert kv.num_used_blocks == 0
    kv.check()
