"""Prefix caching (chapter 7): reuse the K/V of full blocks that an earlier request already computed.

Two requests that start with the same tokens (a system prompt, a few-shot preamble, a chat history)
compute the same K/V for them. A **full** block is identified by a **block hash** chained from the
start of the sequence, as vLLM does::

    block_hash[i] = hash_fn(block_hash[i - 1], token_ids of block i, extra_keys of block i)

so a block's hash stands for its whole prefix, not just its own tokens: the K/V of a token depend on
every token before it. The first block's extra keys carry the request's ``cache_salt``: requests with
different salts (tenants) never share a block, because a hit is observable as a faster first token.

A hash only finds a candidate; a hit is **verified** against what the block stores (its token ids,
its extra keys, and the very entry of the block before it), so a hash collision costs a miss, never
a wrong answer. Shared blocks are reference-counted as forks are (chapter 4). A cached block whose
reference count drops to 0 keeps its K/V: it goes to the most-recently-used end of the **free block
queue**. A fresh block is taken from the other end, and only if that block holds a cached prefix is
it **evicted** (dropped from the cache): eviction of reusable blocks, least recently used first.
That is not preemption, which takes blocks from a *running* request. Free blocks that hold nothing
reusable are handed out before any cached block (vLLM keeps one queue in release order instead).

With a host pool (``num_host_blocks``), an evicted block is not lost: its K/V go to the host's
**cold tier** (:mod:`kvcourse.paged.offload`), and a lookup that misses on the device goes on
there. A cold hit comes back as an :class:`~kvcourse.paged.offload.OffloadedBlock`; :meth:`allocate`
gives it a device block and records the copy, which costs a memory transfer instead of a prefill.

The lookup itself can be swapped (``find_longest_cache_hit``, chapter 7's exercise): a function of the
sequence's tokens that walks their full blocks hash by hash, asks :meth:`~PrefixCachingBlockManager.get_cached_block`
for each, and stops at the first miss, one token short of the end. The engine then admits every
sequence on the blocks it returns, trusting them as vLLM trusts its hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

from .block_hash import BlockHash, CachedBlock, HashFn, extra_keys_of, hash_block_tokens
from .block_manager import BlockManager, num_tokens_to_admit
from .offload import BlockTransfer, OffloadedBlock
from .pool import Admission

if TYPE_CHECKING:
    from ..sequence import Sequence as SequenceState

__all__ = [
    "CachedBlock",
    "FreeBlockQueue",
    "LookupFn",
    "PrefixAdmission",
    "PrefixCachingBlockManager",
    "hash_block_tokens",
]

# find_longest_cache_hit(token_ids, block_size, cache_salt, hash_fn, get_cached_block) -> block ids, in order:
# the blocks that hold the sequence's longest cached prefix (vLLM's KVCacheManager.find_longest_cache_hit).
LookupFn = Callable[[list[int], int, "str | None", HashFn, Callable[[BlockHash], "int | None"]], list[int]]


class PrefixAdmission(NamedTuple):
    """One admission's lookup, logged: sequence ``seq_id`` of ``num_tokens`` tokens (``num_prompt_tokens`` of
    them its prompt: more means it is coming back after a preemption) started on ``num_hit_tokens`` cached."""

    seq_id: Hashable
    num_tokens: int
    num_prompt_tokens: int
    num_hit_tokens: int


class FreeBlockQueue:
    """Free block ids, the next one to hand out first (vLLM's ``FreeKVCacheBlockQueue``).

    An ``OrderedDict`` does the doubly linked list's job: pop the head, push at either end, and
    remove a block from the middle (a cache hit on a free block) all in O(1).
    """

    def __init__(self, blocks: Iterable[int]) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(blocks)

    def popleft(self) -> int:
        return self._queue.popitem(last=False)[0]

    def append(self, block: int) -> None:
        self._queue[block] = None

    def appendleft(self, block: int) -> None:
        self._queue[block] = None
        self._queue.move_to_end(block, last=False)

    def remove(self, block: int) -> None:
        del self._queue[block]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[int]:
        return iter(self._queue)

    def __contains__(self, block: object) -> bool:
        return block in self._queue

    def copy(self) -> FreeBlockQueue:
        new = FreeBlockQueue(())
        new._queue = self._queue.copy()
        return new


class PrefixCachingBlockManager(BlockManager):
    """A :class:`BlockManager` whose full blocks outlive their sequences, found again by block hash.

    Args:
        num_blocks, block_size: the pool.
        hash_fn: ``hash_fn(parent_block_hash, token_ids, extra_keys) -> hashable``
            (:func:`hash_block_tokens`); tests give a colliding one.
        num_host_blocks: host blocks for swapped sequences and for the cold tier of evicted cached
            blocks (0: evicted blocks are dropped).
        find_longest_cache_hit: the lookup admission uses (a :data:`LookupFn`); ``None``, the default:
            :meth:`find_cached_blocks`. Also settable later (``engine.block_manager.find_longest_cache_hit = fn``).

    The scheduler admits a sequence with :meth:`admit` (:meth:`find_cached_blocks`, then :meth:`allocate`
    with the hits), and after every forward calls :meth:`cache_full_blocks` for the blocks that filled up.
    It is a :class:`~kvcourse.paged.pool.PrefixCachingPool`.
    """

    enable_prefix_caching = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_fn: HashFn = hash_block_tokens,
        num_host_blocks: int = 0,
        find_longest_cache_hit: LookupFn | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, num_host_blocks)
        if not callable(hash_fn):
            raise TypeError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
        if find_longest_cache_hit is not None and not callable(find_longest_cache_hit):
            raise TypeError(
                f"find_longest_cache_hit must be callable or None, got {type(find_longest_cache_hit).__name__}"
            )
        self.hash_fn = hash_fn
        self.find_longest_cache_hit = find_longest_cache_hit
        self.admissions: list[PrefixAdmission] = []  # every admission's lookup, in order
        self._free = FreeBlockQueue(range(num_blocks))  # type: ignore[assignment]  (same calls as the deque)
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, CachedBlock]] = {}
        self._cached: dict[int, CachedBlock] = {}  # block id -> what it holds
        self._num_cached_blocks: dict[Hashable, int] = {}  # seq_id -> leading blocks of its table in the cache
        # seq_id -> the entry of its last cached block: the parent of the next block it caches. (Its own
        # block may hold a copy of that entry's K/V instead of the entry's block, after a swap.)
        self._last_cached: dict[Hashable, CachedBlock] = {}
        self._swapped_chains: dict[Hashable, tuple[int, CachedBlock | None]] = {}  # the two above, while swapped
        self.num_evictions = 0  # cached blocks given to new tokens (moved to the host tier or dropped)
        self.num_offloaded_blocks = 0  # of those, kept in the host's cold tier
        self.num_host_hit_blocks = 0  # cold blocks brought back by a hit

    # ---- queries ------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable prefix, in use or free."""
        return len(self._cached)

    def cached_block(self, block: int) -> CachedBlock | None:
        """What ``block`` holds, if it is in the cache."""
        return self._cached.get(block)

    def find_cached_blocks(
        self, token_ids: Sequence[int], cache_salt: str | None = None, block_hashes: list | None = None
    ) -> list[int | OffloadedBlock]:
        """The longest run of ``token_ids``' full blocks found in the cache, verified: their block ids
        (an :class:`OffloadedBlock` for a hit in the host's cold tier).

        ``block_hashes``: the chained hashes of the first blocks of these same tokens, computed by an
        earlier lookup (a sequence's :attr:`~kvcourse.Sequence.block_hashes`); the lookup reads them
        and appends the ones it computes, so a prompt waiting many steps is hashed once.
        """
        bs, hits, parent = self.block_size, [], None
        hashes = [] if block_hashes is None else block_hashes
        for i in range(len(token_ids) // bs):
            tokens, extra = tuple(token_ids[i * bs : (i + 1) * bs]), extra_keys_of(i, cache_salt)
            if i == len(hashes):  # hashed lazily: the walk stops at the first miss
                hashes.append(self.hash_fn(hashes[-1] if i else None, tokens, extra))
            block_hash = hashes[i]
            candidates = self.cached_block_hash_to_block.get(block_hash, {})
            match = next((b for b, e in candidates.items() if e.holds(tokens, extra, parent)), None)
            if match is not None:
                hits.append(match)
                parent = self._cached[match]
                continue
            cold = self.host.find_cold(block_hash, tokens, extra, parent)  # the host tier, if any
            if cold is None:
                break
            hits.append(OffloadedBlock(cold))
            parent = self.host.cold_entry(cold)
        return hits

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """A device block cached under ``block_hash``, or ``None`` (vLLM's ``BlockPool.get_cached_block``).

        The hash alone decides, as in vLLM: what the block holds is not compared (:meth:`find_cached_blocks`
        compares it). The host tier is not searched.
        """
        candidates = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(candidates)) if candidates else None

    def lookup(self, seq: SequenceState, cache_salt: str | None = None) -> list[int | OffloadedBlock]:
        """The cached blocks ``seq`` is admitted on: :meth:`find_cached_blocks` of all its tokens but the
        last (its logits give the next token), or what ``find_longest_cache_hit`` returns, checked."""
        if self.find_longest_cache_hit is None:
            return self.find_cached_blocks(seq.token_ids[:-1], cache_salt, seq.block_hashes)
        hits = self.find_longest_cache_hit(
            list(seq.token_ids), self.block_size, cache_salt, self._full_block_hash, self.get_cached_block
        )
        return self._check_hits(hits, seq.num_tokens)

    def blocks_to_allocate(self, num_tokens: int, cached_blocks: Sequence[int | OffloadedBlock] = ()) -> int:
        """Free blocks ``allocate(seq_id, num_tokens, cached_blocks)`` would take: the new ones, plus
        each hit that is itself sitting in the free queue or in the host tier."""
        new = self.blocks_needed(num_tokens) - len(cached_blocks)
        return new + sum(1 for b in cached_blocks if isinstance(b, OffloadedBlock) or self._ref_counts[b] == 0)

    # ---- operations ---------------------------------------------------------
    def admit(
        self,
        seq: SequenceState,
        max_num_new_tokens: int,
        *,
        chunked: bool = True,
        keep_free: int = 0,
        cache_salt: str | None = None,
    ) -> Admission | None:
        """Allocate ``seq``'s first slots if they fit, its cached prefix shared, leaving ``keep_free``
        blocks free (see :meth:`KVPool.admit <kvcourse.paged.pool.KVPool.admit>`).

        The lookup (:meth:`lookup`) stops one token short: the last token is always fed, its logits give
        the next token. Each admission is logged in :attr:`admissions`.
        """
        hits = self.lookup(seq, cache_salt)
        num_cached = len(hits) * self.block_size
        n = num_tokens_to_admit(seq.num_tokens - num_cached, max_num_new_tokens, chunked)
        if n is None or self.blocks_to_allocate(num_cached + n, hits) > len(self._free) - keep_free:
            return None
        self.allocate(seq.seq_id, num_cached + n, hits)
        self.admissions.append(PrefixAdmission(seq.seq_id, seq.num_tokens, seq.num_prompt_tokens, num_cached))
        return Admission(num_cached, n)

    def allocate(
        self, seq_id: Hashable, num_tokens: int, cached_blocks: Sequence[int | OffloadedBlock] = ()
    ) -> list[int]:
        """Create ``seq_id`` with slots for ``num_tokens`` tokens, the first blocks being ``cached_blocks``
        (hits from :meth:`find_cached_blocks`, shared, not recomputed); return its table.

        A hit in the host tier gets a fresh device block and a recorded copy (:meth:`take_transfers`).
        """
        self._check_new(seq_id, "seq_id")
        cached = list(cached_blocks)
        if len(cached) > self.blocks_needed(num_tokens):
            raise ValueError(f"cached_blocks: {len(cached)} blocks hold more than num_tokens={num_tokens}")
        stale = [
            b
            for b in cached
            if (not self.host.is_cold(b.host_block) if isinstance(b, OffloadedBlock) else b not in self._cached)
        ]
        if stale:
            raise ValueError(f"cached_blocks {stale} are not in the prefix cache (evicted since the lookup?)")
        self._require(self.blocks_to_allocate(num_tokens, cached), f"allocate {num_tokens} tokens for {seq_id!r}")
        on_device = [b for b in cached if not isinstance(b, OffloadedBlock)]
        for block in on_device:  # taken first, so the fresh blocks below cannot evict them
            if self._ref_counts[block] == 0:
                self._free.remove(block)
            self._ref_counts[block] += 1
        # Host hits leave the cold tier before any device block is taken: an eviction below moves a
        # block to the host, and must not land on a hit not yet copied back. Their host blocks are
        # freed only once their copies are recorded.
        entries = {b.host_block: self.host.pop_cold(b.host_block) for b in cached if isinstance(b, OffloadedBlock)}
        table = []
        for b in cached:
            if isinstance(b, OffloadedBlock):
                block = self._take()
                self._transfers.append(BlockTransfer("to_device", b.host_block, block))
                self._add_to_cache(block, entries[b.host_block])
                self.num_host_hit_blocks += 1
                b = block
            table.append(b)
        self.host.free(list(entries))
        table += [self._take() for _ in range(self.blocks_needed(num_tokens) - len(cached))]
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = num_tokens
        self._num_cached_blocks[seq_id] = len(cached)
        if cached:
            self._last_cached[seq_id] = self._cached[table[len(cached) - 1]]
        return list(table)

    def cache_full_blocks(
        self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int, cache_salt: str | None = None
    ) -> None:
        """Put ``seq_id``'s blocks that are now full of computed K/V into the cache (call after the forward).

        ``token_ids``: the sequence's tokens, of which the first ``num_computed_tokens`` have K/V written.
        """
        table, bs = self._table(seq_id), self.block_size
        if not 0 <= num_computed_tokens <= len(token_ids):
            raise ValueError(f"num_computed_tokens must be in [0, {len(token_ids)}], got {num_computed_tokens}")
        done = self._num_cached_blocks[seq_id]
        num_full = min(num_computed_tokens // bs, len(table))
        parent = self._last_cached.get(seq_id) if done else None
        for i in range(done, num_full):
            tokens, extra = tuple(token_ids[i * bs : (i + 1) * bs]), extra_keys_of(i, cache_salt)
            block_hash = self.hash_fn(None if parent is None else parent.block_hash, tokens, extra)
            entry = CachedBlock(block_hash, tokens, extra, parent)
            self._add_to_cache(table[i], entry)
            parent = entry
        self._num_cached_blocks[seq_id] = max(done, num_full)
        if parent is not None:
            self._last_cached[seq_id] = parent

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        super().fork(parent_id, child_id)
        self._num_cached_blocks[child_id] = self._num_cached_blocks[parent_id]
        if parent_id in self._last_cached:
            self._last_cached[child_id] = self._last_cached[parent_id]

    def swap_out(self, seq_id: Hashable) -> list[BlockTransfer]:
        """As :meth:`BlockManager.swap_out`; the sequence's cached blocks stay in the cache (freed), and
        how far its blocks were cached is remembered for its return."""
        chain = (self._num_cached_blocks.get(seq_id, 0), self._last_cached.get(seq_id))
        moves = super().swap_out(seq_id)  # frees seq_id, which forgets its chain
        self._swapped_chains[seq_id] = chain
        return moves

    def swap_in(self, seq_id: Hashable) -> list[BlockTransfer]:
        """As :meth:`BlockManager.swap_in`. The fresh blocks hold copies of blocks that were cached: they
        are not cached a second time; the blocks after them join the cache as they fill, chained to
        the last cached entry as if the sequence had never left."""
        moves = super().swap_in(seq_id)
        done, last = self._swapped_chains.pop(seq_id)
        self._num_cached_blocks[seq_id] = done
        if last is not None:
            self._last_cached[seq_id] = last
        return moves

    def free_swapped(self, seq_id: Hashable) -> None:
        super().free_swapped(seq_id)
        del self._swapped_chains[seq_id]

    def free(self, seq_id: Hashable) -> None:
        """Release ``seq_id``. Its cached blocks keep their K/V at the recently-used end of the free queue
        (its last block nearest the eviction end); blocks with nothing reusable go to the front."""
        table = self._table(seq_id)
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._cached:
                    self._free.append(block)
                else:
                    self._free.appendleft(block)
        del self._tables[seq_id], self._num_tokens[seq_id], self._num_cached_blocks[seq_id]
        self._last_cached.pop(seq_id, None)

    def snapshot(self) -> dict:
        """:meth:`BlockManager.snapshot`, and the cache's own maps and counters."""
        state = super().snapshot()
        state.update(
            num_admissions=len(self.admissions),  # only ever appended to
            cached_block_hash_to_block=dict(self.cached_block_hash_to_block),  # buckets are never changed in place
            _cached=dict(self._cached),
            _num_cached_blocks=dict(self._num_cached_blocks),
            _last_cached=dict(self._last_cached),
            _swapped_chains=dict(self._swapped_chains),
            num_evictions=self.num_evictions,
            num_offloaded_blocks=self.num_offloaded_blocks,
            num_host_hit_blocks=self.num_host_hit_blocks,
        )
        return state

    def restore(self, state: dict) -> None:
        state = dict(state)
        del self.admissions[state.pop("num_admissions") :]
        super().restore(state)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no sequence holds, the host tier's too (a benchmark's cold
        start); return how many."""
        idle = [b for b in self._cached if self._ref_counts[b] == 0]
        for block in idle:
            self._evict(block)
            self._free.remove(block)
            self._free.appendleft(block)
        return len(idle) + self.host.clear_cold()

    # ---- internals ----------------------------------------------------------
    def _full_block_hash(
        self, parent_block_hash: BlockHash | None, token_ids: Sequence[int], extra_keys=()
    ) -> BlockHash:
        """``hash_fn`` as a custom lookup gets it: only a full block has a hash (a partial one is never cached)."""
        if len(token_ids) != self.block_size:
            raise ValueError(
                f"token_ids: a block hash is for a full block of {self.block_size} tokens, got "
                f"{len(token_ids)} (a partly filled block is never cached)"
            )
        return self.hash_fn(parent_block_hash, tuple(token_ids), tuple(extra_keys))

    def _check_hits(self, hits: object, num_tokens: int) -> list[int]:
        """A custom lookup's answer, checked for what would break the engine (not for being the right blocks)."""
        name = "find_longest_cache_hit"
        if not isinstance(hits, (list, tuple)):
            raise TypeError(f"{name} must return a list of block ids, got {type(hits).__name__}")
        for b in hits:
            if isinstance(b, bool) or not isinstance(b, int) or b not in self._cached:
                raise ValueError(f"{name} returned {b!r}, which is not a cached block (get_cached_block's answers are)")
        if len(set(hits)) != len(hits):
            raise ValueError(f"{name} returned a block twice: {list(hits)}")
        if len(hits) * self.block_size >= num_tokens:
            raise ValueError(
                f"{name} returned {len(hits)} blocks ({len(hits) * self.block_size} tokens) for a sequence of "
                f"{num_tokens} tokens: stop one token short, the last token must be computed for its logits"
            )
        return list(hits)

    def _take(self) -> int:
        block = self._free.popleft()
        if block in self._cached:  # the least recently used reusable block: evict it
            entry = self._evict(block)
            self.num_evictions += 1
            host_block = self.host.put_cold(entry) if self.host.num_blocks else None
            if host_block is not None:  # keep its K/V in the host tier: copied before anyone writes here
                self._transfers.append(BlockTransfer("to_host", block, host_block))
                self.num_offloaded_blocks += 1
        self._ref_counts[block] = 1
        return block

    def _add_to_cache(self, block: int, entry: CachedBlock) -> None:
        self._cached[block] = entry
        # Two requests that computed the same prefix at once both stay cached, as in vLLM. A bucket is
        # replaced, never changed in place, so that snapshot() copies the outer map only.
        bucket = self.cached_block_hash_to_block.get(entry.block_hash, {})
        self.cached_block_hash_to_block[entry.block_hash] = {**bucket, block: entry}

    def _evict(self, block: int) -> CachedBlock:
        entry = self._cached.pop(block)
        bucket = {b: e for b, e in self.cached_block_hash_to_block[entry.block_hash].items() if b != block}
        if bucket:
            self.cached_block_hash_to_block[entry.block_hash] = bucket
        else:
            del self.cached_block_hash_to_block[entry.block_hash]
        return entry

    def __repr__(self) -> str:
        return (
            f"PrefixCachingBlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free_blocks}, cached={self.num_cached_blocks}, seqs={len(self._tables)}, "
            f"host_cold={self.host.num_cold_blocks})"
        )
