"""What identifies a cached block (chapter 7): a hash chained from the start of the sequence, and an entry to verify it.

A block's K/V depend on every token before it, so its identity is its whole prefix:
``block_hash[i] = hash_fn(block_hash[i - 1], token_ids of block i, extra_keys of block i)``.
The prefix cache (:mod:`.prefix_cache`) finds blocks on the device by it, and the host tier
(:mod:`.offload`) finds evicted ones by it.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

__all__ = ["CachedBlock", "extra_keys_of", "hash_block_tokens"]

BlockHash = Hashable
HashFn = Callable[[BlockHash | None, tuple[int, ...], tuple], BlockHash]


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """SHA-256 of (the parent block's hash, this block's token ids, its extra keys).

    ``parent_block_hash`` is ``None`` for the first block. Python's ``hash()`` would be faster but is
    salted per process for strings and easy to collide on purpose; SHA-256 is what vLLM defaults to.
    """
    payload = pickle.dumps((parent_block_hash, tuple(token_ids), tuple(extra_keys)), protocol=4)
    return hashlib.sha256(payload).digest()


def extra_keys_of(block_index: int, cache_salt: str | None) -> tuple:
    """The extra keys of block ``block_index``: the salt goes into the first block only (the chain carries it on)."""
    return (cache_salt,) if block_index == 0 and cache_salt is not None else ()


@dataclass(frozen=True, eq=False)
class CachedBlock:
    """What a cached block holds, kept to verify a hit: the hash says "probably", these say "surely".

    ``parent`` is the entry of the block before it (``None`` for a first block). It is compared by
    identity: a parent block evicted and filled again is a new entry, so its old children never match.
    """

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    extra_keys: tuple
    parent: CachedBlock | None

    def holds(self, token_ids: tuple[int, ...], extra_keys: tuple, parent: CachedBlock | None) -> bool:
        """Whether this entry really is that block: equal hashes are a candidate, not a proof."""
        return self.token_ids == token_ids and self.extra_keys == extra_keys and self.parent is parent
