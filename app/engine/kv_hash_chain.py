"""The hash chain of a sequence's full KV blocks: what the prefix cache is keyed by.

Each full block's digest covers its tokens and its parent's digest (the first block's parent
is a salt), so equal digests mean equal whole prefixes (vLLM's automatic prefix caching); the
digest is BLAKE2b-128, so a collision is never a concern in practice. The salt separates
prefixes that must not mix (:data:`SALT_EXACT` for seeded, batch-invariant requests).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

SALT_ANY = b"slotserve-kv-any"
SALT_EXACT = b"slotserve-kv-exact"


def chain_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes, known: list[BlockHash] | None = None
) -> list[BlockHash]:
    """The digest of every full block of ``token_ids``: ``h[i] = H(h[i-1] || tokens of block i)``
    with ``h[-1] = salt``. ``known`` (a previous result for a prefix of the same tokens and salt)
    is extended in place and returned, so a growing sequence hashes each block once."""
    hashes = known if known is not None else []
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[index - 1] if index else salt
        tokens = array("i", token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest())
    return hashes
