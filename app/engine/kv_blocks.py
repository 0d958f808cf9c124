"""The block manager: the logical state of a paged KV cache, on the scheduler's side (rule R12).

The model owns the KV tensors (a pool of ``num_blocks`` blocks of ``block_size`` positions) and
only writes and reads where a row's block table says (:class:`app.models.base.KVBlocks`). Which
block holds what is decided here, and only here:

* **reference counts**: a block is held by every sequence whose table names it; several
  sequences share the blocks of a common cached prefix;
* **block tables**: each sequence's list of blocks, position ``p`` in ``table[p // block_size]``;
* **the hash chain** of each full block: a digest of its tokens and its parent's digest (the
  first block's parent is a salt), so equal digests mean equal whole prefixes (vLLM's automatic
  prefix caching, docs.vllm.ai "Automatic Prefix Caching"; the digest is BLAKE2b-128, so a
  collision is never a concern in practice);
* **the free list**, an LRU: a block whose last holder let go goes to its tail when it holds a
  cached (hashed) prefix, so it can still be hit until it is evicted, and to its head when it
  holds nothing reusable; a new block is taken from the head, evicting the cached prefix it held.
  A finishing sequence frees its blocks last to first, so its deepest blocks are evicted first
  and the head of a shared prefix survives longest.

A block is registered in the cache only by :meth:`BlockManager.commit`, which the scheduler calls
after a model step *completed* and with the number of positions actually written: a sequence
cancelled or failed mid-prefill leaves nothing half written in the cache. Block 0
(:data:`app.models.base.NULL_BLOCK`) is never handed out.

The salt separates prefixes that must not mix: a seeded (batch-invariant) request's KV is
computed the exact way, and a cached prefix computed otherwise could round differently and
change its tokens (API.md's seed promise), so the two kinds never share blocks.

Owners are any hashable objects compared by identity-based hash (the scheduler passes its
``Sequence`` objects, ``eq=False``): a request id reused by a new request is a new owner.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from app.engine.kv_hash_chain import BlockHash, chain_hashes
from app.models.base import NULL_BLOCK, ModelCapabilities


class AdmitOutcome(enum.Enum):
    """How :meth:`BlockManager.admit` ended (rule R06): ``ADMITTED`` (the owner holds blocks
    for all its tokens); ``NO_ROOM`` (too few free blocks: nothing changed, admission should
    stop, FIFO); ``PREFIX_IN_FLIGHT`` (the next block of its prefix is being computed by
    another owner: nothing changed, it tries again after that owner's step, so the prefix is
    computed once)."""

    ADMITTED = "admitted"
    NO_ROOM = "no_room"
    PREFIX_IN_FLIGHT = "prefix_in_flight"


@dataclass(frozen=True, slots=True)
class Admission:
    """The result of :meth:`BlockManager.admit`.

    Attributes:
        outcome: admitted, or why not.
        num_cached_tokens: when admitted, the positions already computed (its cached prefix,
            a multiple of the block size; 0 without a hit); 0 otherwise.
    """

    outcome: AdmitOutcome
    num_cached_tokens: int = 0

    @property
    def admitted(self) -> bool:
        return self.outcome is AdmitOutcome.ADMITTED


NO_ROOM = Admission(AdmitOutcome.NO_ROOM)
PREFIX_IN_FLIGHT = Admission(AdmitOutcome.PREFIX_IN_FLIGHT)


@dataclass(slots=True)
class _Holding:
    """What one owner holds: its block table and how much of it is registered."""

    salt: bytes
    blocks: list[int] = field(default_factory=list)
    # Full blocks whose content is accounted for: hit at allocation or registered by commit.
    committed: int = 0
    # Digests of full blocks this owner is computing that no block holds yet (see pending).
    pending: list[BlockHash] = field(default_factory=list)


class BlockManager:
    """Free list, reference counts, block tables, hash chains and the LRU of cached blocks.

    Args:
        num_blocks: blocks in the model's pool, the null block 0 included (>= 2).
        block_size: positions per block (>= 1).
        prefix_caching: reuse cached full blocks at allocation; False: blocks are never hashed.

    Raises:
        ValueError: ``num_blocks < 2`` or ``block_size < 1``.
    """

    def __init__(self, *, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"need >= 2 blocks of >= 1 position, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict(
            (block, None) for block in range(num_blocks) if block != NULL_BLOCK
        )
        self._holdings: dict[Hashable, _Holding] = {}
        # Digests of the prompts of owners not yet holding blocks (waiting), kept between tries.
        self._hashes: dict[Hashable, list[BlockHash]] = {}
        self._pending: dict[BlockHash, int] = {}

    @classmethod
    def for_model(cls, capabilities: ModelCapabilities, *, prefix_caching: bool) -> BlockManager:
        """The manager of a paged model's pool (``capabilities.num_kv_blocks`` of
        ``kv_block_size`` positions, block 0 the null block).

        Raises:
            ValueError: the pool cannot hold one sequence of the model's context length.
        """
        needed = -(-capabilities.context_length // capabilities.kv_block_size)
        if capabilities.num_kv_blocks - 1 < needed:
            raise ValueError(
                f"the KV cache holds {capabilities.num_kv_blocks - 1} blocks of "
                f"{capabilities.kv_block_size} positions, less than one sequence of the "
                f"context length {capabilities.context_length} needs ({needed})"
            )
        return cls(
            num_blocks=capabilities.num_kv_blocks,
            block_size=capabilities.kv_block_size,
            prefix_caching=prefix_caching,
        )

    # ----------------------------------------------------------------- read-only views

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_usable_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered prefix, held or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Held blocks / usable blocks, in [0, 1]; cached free blocks count as free."""
        return self.num_used_blocks / self.num_usable_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def table(self, owner: Hashable) -> tuple[int, ...]:
        """``owner``'s block table (empty when it holds none)."""
        holding = self._holdings.get(owner)
        return tuple(holding.blocks) if holding is not None else ()

    def holds(self, owner: Hashable) -> bool:
        return owner in self._holdings

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # ----------------------------------------------------------------- admission

    def cached_prefix(self, owner: Hashable, token_ids: Sequence[int], salt: bytes) -> list[int]:
        """The blocks of the longest cached run of full blocks at the start of ``token_ids``.

        At most ``(len(token_ids) - 1) // block_size`` blocks: at least the last token is always
        computed (its logits are wanted), and what is computed starts at a block boundary, so a
        hit never writes into a shared block. Empty when prefix caching is off.
        """
        if not self.prefix_caching:
            return []
        hashes = self._prompt_hashes(owner, token_ids, salt)
        blocks: list[int] = []
        for digest in hashes[: (len(token_ids) - 1) // self.block_size]:
            block = self._cached.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def prefix_in_flight(
        self, owner: Hashable, token_ids: Sequence[int], salt: bytes, num_hit: int
    ) -> bool:
        """True when the first full block of ``token_ids`` after a hit of ``num_hit`` blocks is
        being computed right now by another holder: waiting a little for it to be committed
        lets a shared prefix be computed once (many requests with one system prompt, ``n`` > 1).
        """
        if not self.prefix_caching or not self._pending:
            return False
        hashes = self._prompt_hashes(owner, token_ids, salt)
        reusable = (len(token_ids) - 1) // self.block_size
        return num_hit < reusable and hashes[num_hit] in self._pending

    def allocate(
        self, owner: Hashable, token_ids: Sequence[int], salt: bytes, *, num_tokens: int
    ) -> int | None:
        """Gives ``owner`` a block table covering ``num_tokens`` positions of ``token_ids``, its
        cached prefix reused. Returns the positions already computed (the hit, a multiple of
        ``block_size``), or None when the blocks do not fit (nothing changes).

        Raises:
            ValueError: ``owner`` already holds blocks, or ``num_tokens`` is not in
                ``[1, len(token_ids)]``.
        """
        if owner in self._holdings:
            raise ValueError("owner already holds blocks")
        if not 1 <= num_tokens <= len(token_ids):
            raise ValueError(f"num_tokens {num_tokens} outside [1, {len(token_ids)}]")
        hit = self.cached_prefix(owner, token_ids, salt)
        hit = hit[: (num_tokens - 1) // self.block_size]
        needed = self.blocks_for(num_tokens) - len(hit)
        free_hits = sum(self._ref_counts[block] == 0 for block in hit)
        if needed > len(self._free) - free_hits:
            return None
        for block in hit:
            self._take(block)
        holding = _Holding(salt=salt, blocks=list(hit), committed=len(hit))
        holding.blocks.extend(self._pop_free() for _ in range(needed))
        if self.prefix_caching:
            hashes = self._prompt_hashes(owner, token_ids, salt)
            for digest in hashes[len(hit) : num_tokens // self.block_size]:
                if digest not in self._cached:
                    holding.pending.append(digest)
                    self._pending[digest] = self._pending.get(digest, 0) + 1
        self._holdings[owner] = holding
        return len(hit) * self.block_size

    def admit(self, owner: Hashable, token_ids: Sequence[int], salt: bytes) -> Admission:
        """``allocate`` for all of ``token_ids`` (a sequence about to prefill them), unless
        the next block of its prefix is being computed by another owner (``PREFIX_IN_FLIGHT``:
        nothing changes). ``NO_ROOM`` when ``allocate`` finds no room; else admitted, with
        the positions already computed."""
        hit = self.cached_prefix(owner, token_ids, salt)
        if self.prefix_in_flight(owner, token_ids, salt, len(hit)):
            return PREFIX_IN_FLIGHT
        computed = self.allocate(owner, token_ids, salt, num_tokens=len(token_ids))
        if computed is None:
            return NO_ROOM
        return Admission(AdmitOutcome.ADMITTED, computed)

    # ----------------------------------------------------------------- growth and commit

    def grow(self, owner: Hashable, num_tokens: int) -> bool:
        """Extends ``owner``'s table to cover ``num_tokens`` positions; False (nothing changes)
        when there are not enough free blocks.

        Raises:
            KeyError: ``owner`` holds no blocks.
        """
        holding = self._holdings[owner]
        needed = self.blocks_for(num_tokens) - len(holding.blocks)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        holding.blocks.extend(self._pop_free() for _ in range(needed))
        return True

    def shrink(self, owner: Hashable, num_tokens: int) -> None:
        """Cuts ``owner``'s table back to the blocks ``num_tokens`` positions need (a rollback
        of positions computed and then rejected); only blocks past the committed ones go, to
        the head of the free list (nothing in them is worth keeping). A no-op for an owner
        holding no blocks or no more than that."""
        holding = self._holdings.get(owner)
        if holding is None:
            return
        keep = max(self.blocks_for(num_tokens), holding.committed)
        while len(holding.blocks) > keep:
            block = holding.blocks.pop()
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                self._free.move_to_end(block, last=False)

    def commit(self, owner: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Registers ``owner``'s blocks that are now full: a step that completed wrote
        positions ``[0, num_computed)`` of ``token_ids``. A block whose prefix another block
        already holds stays unregistered (it is reused for anything once freed).

        Raises:
            KeyError: ``owner`` holds no blocks.
            ValueError: ``num_computed`` beyond the table or the tokens.
        """
        holding = self._holdings[owner]
        full = num_computed // self.block_size
        if num_computed > len(token_ids) or full > len(holding.blocks):
            raise ValueError(f"{num_computed} positions computed, table of {len(holding.blocks)}")
        if full <= holding.committed:
            return
        if self.prefix_caching:
            hashes = self._hashes.setdefault(owner, [])
            chain_hashes(token_ids[: full * self.block_size], self.block_size, holding.salt, hashes)
            for index in range(holding.committed, full):
                digest, block = hashes[index], holding.blocks[index]
                if digest not in self._cached and self._hash_of[block] is None:
                    self._cached[digest] = block
                    self._hash_of[block] = digest
            self._settle_pending(holding, set(hashes[holding.committed : full]))
        holding.committed = full

    # ----------------------------------------------------------------- release

    def free(self, owner: Hashable) -> None:
        """Lets go of everything ``owner`` holds or had hashed; a no-op for an unknown owner."""
        self._hashes.pop(owner, None)
        holding = self._holdings.pop(owner, None)
        if holding is None:
            return
        self._settle_pending(holding, set(holding.pending))
        for block in reversed(holding.blocks):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._hash_of[block] is None:
                    self._free.move_to_end(block, last=False)  # nothing to keep: reuse first

    def check(self) -> None:
        """Asserts the invariants (tests): reference counts equal the tables naming each block,
        the free list is exactly the unreferenced blocks, the cache index matches the blocks.

        Raises:
            AssertionError: an invariant is broken.
        """
        counts = [0] * self.num_blocks
        for holding in self._holdings.values():
            for block in holding.blocks:
                counts[block] += 1
        assert counts == self._ref_counts, "reference counts differ from the tables"
        assert counts[NULL_BLOCK] == 0 and NULL_BLOCK not in self._free, "null block handed out"
        unreferenced = {b for b in range(self.num_blocks) if b != NULL_BLOCK and counts[b] == 0}
        assert set(self._free) == unreferenced, "free list differs from unreferenced blocks"
        assert all(self._hash_of[b] == d for d, b in self._cached.items()), "cache index broken"
        assert sum(d is not None for d in self._hash_of) == len(self._cached), "stray hashes"
        pending: dict[BlockHash, int] = {}
        for holding in self._holdings.values():
            for digest in holding.pending:
                pending[digest] = pending.get(digest, 0) + 1
        assert pending == self._pending, "pending digests differ from the holdings'"

    # ----------------------------------------------------------------- internals

    def _prompt_hashes(
        self, owner: Hashable, token_ids: Sequence[int], salt: bytes
    ) -> list[BlockHash]:
        hashes = self._hashes.setdefault(owner, [])
        if len(hashes) > len(token_ids) // self.block_size:
            del hashes[len(token_ids) // self.block_size :]
        return chain_hashes(token_ids, self.block_size, salt, hashes)

    def _take(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        digest = self._hash_of[block]
        if digest is not None:  # evicted: its prefix can no longer be hit
            del self._cached[digest]
            self._hash_of[block] = None
        self._ref_counts[block] = 1
        return block

    def _settle_pending(self, holding: _Holding, done: set[BlockHash]) -> None:
        kept = []
        for digest in holding.pending:
            if digest in done:
                self._pending[digest] -= 1
                if self._pending[digest] == 0:
                    del self._pending[digest]
            else:
                kept.append(digest)
        holding.pending = kept
