"""The block allocator behind a paged KV cache (vLLM's ``BlockManager``, nano-vllm's ``block_manager.py``).

KV memory is cut into ``num_blocks`` fixed-size **blocks** of ``block_size`` token
slots each. A sequence owns a **block table**: the list of physical block ids that
hold its tokens, in order, so token ``pos`` lives in block ``table[pos // block_size]``
at offset ``pos % block_size``. Blocks need not be adjacent, so memory is handed
out one block at a time as a sequence grows instead of reserved for its maximum
length up front: at most ``block_size - 1`` slots per sequence are ever wasted.

Blocks can be **shared**. :meth:`BlockManager.fork` gives a child sequence the
parent's whole table (parallel sampling, beam search: the prompt is stored once)
and counts the extra owner in each block's **reference count**. Full blocks are
never written again, so sharing them is free. The last block may still be
partially filled: the first sequence to append into a shared one gets a private
copy (**copy-on-write**), and :meth:`append_slot` reports ``(src_block, dst_block)``
so the caller copies the K/V data too. A block returns to the free list when its
reference count drops to zero.

With a host pool (``num_host_blocks``, chapter 7), a sequence can be **swapped**: :meth:`swap_out`
moves its blocks to host memory and frees them here, :meth:`swap_in` brings them back into fresh
blocks. Each move is recorded as a :class:`~kvcourse.paged.offload.BlockTransfer`; the caller
takes them with :meth:`take_transfers` and copies the data before the next forward.

This module only does bookkeeping (pure Python, no tensors); the K/V data lives in
:class:`kvcourse.paged.PagedKVStore`, and the slot a token's K/V goes to is
:func:`kvcourse.batch.slot_mapping` of its block table. Every operation either succeeds completely
or raises and leaves the state exactly as it was.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING

from ..checks import check_int
from .offload import BlockTransfer, HostBlockPool
from .pool import Admission, CopyOnWrite

if TYPE_CHECKING:
    from ..sequence import Sequence

__all__ = ["BlockManager", "NoFreeBlocksError", "num_tokens_to_admit"]


class NoFreeBlocksError(RuntimeError):
    """Raised when an operation needs more free blocks than remain. Nothing was changed."""


def num_tokens_to_admit(num_uncached: int, max_num_new_tokens: int, chunked: bool) -> int | None:
    """Tokens a sequence with ``num_uncached`` tokens to compute feeds at admission: all of them, or a
    chunk of ``max_num_new_tokens`` when ``chunked``; ``None`` when they must all fit and do not."""
    if num_uncached <= max_num_new_tokens:
        return num_uncached
    return max_num_new_tokens if chunked else None


class BlockManager:
    """Free list, per-block reference counts and per-sequence block tables.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: token slots per block.
        num_host_blocks: blocks of host memory for swapped sequences (0: no swapping).

    Sequence ids are any hashable value (ints in the course). Unknown ids, reused ids
    and double frees raise ``ValueError``; running out of blocks raises
    :class:`NoFreeBlocksError`. It is a :class:`~kvcourse.paged.pool.PagedKVPool`.
    """

    enable_prefix_caching = False

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        self.num_blocks = check_int("num_blocks", num_blocks, min=1)
        self.block_size = check_int("block_size", block_size, min=1)
        self.host = HostBlockPool(check_int("num_host_blocks", num_host_blocks, min=0))
        self._swapped: dict[Hashable, tuple[list[int], int]] = {}  # seq_id -> (host blocks, num_tokens)
        self._transfers: list[BlockTransfer] = []  # moves decided since the last take_transfers()
        # A FIFO free list, as in nano-vllm: blocks come back at the tail and are handed out
        # from the head, so a freshly made pool hands out 0, 1, 2, ... (easy to read in a demo).
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        self._num_tokens: dict[Hashable, int] = {}

    # ---- queries ------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (reference count 0)."""
        return len(self._free)

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host pool (0: no swapping)."""
        return self.host.num_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by at least one sequence (a shared block counts once)."""
        return self.num_blocks - len(self._free)

    @property
    def seq_ids(self) -> list[Hashable]:
        """Ids of the live sequences, in allocation order."""
        return list(self._tables)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of ``seq_id``'s block table: physical block ids in token order."""
        return list(self._table(seq_id))

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` holds slots for."""
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def ref_count(self, block: int) -> int:
        """How many sequences' tables contain ``block`` (0 means it is free)."""
        check_int("block", block, min=0)
        if block >= self.num_blocks:
            raise ValueError(f"block must be in [0, {self.num_blocks}), got {block}")
        return self._ref_counts[block]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        check_int("num_tokens", num_tokens, min=0)
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits in the free blocks."""
        return self.blocks_needed(num_tokens) <= len(self._free)

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether ``append_slots(seq_id, num_tokens)`` would succeed."""
        return self.blocks_to_append(seq_id, num_tokens) <= len(self._free)

    def blocks_to_append(self, seq_id: Hashable, num_tokens: int = 1) -> int:
        """Free blocks ``append_slots(seq_id, num_tokens)`` would take (a copy-on-write copy included)."""
        return self._blocks_needed_to_append(seq_id, num_tokens)

    # ---- operations ---------------------------------------------------------
    def admit(
        self,
        seq: Sequence,
        max_num_new_tokens: int,
        *,
        chunked: bool = True,
        keep_free: int = 0,
        cache_salt: str | None = None,
    ) -> Admission | None:
        """Allocate ``seq``'s first slots if they fit, leaving ``keep_free`` blocks free (see
        :meth:`KVPool.admit <kvcourse.paged.pool.KVPool.admit>`). Nothing is cached here, and ``cache_salt``
        is unused."""
        n = num_tokens_to_admit(seq.num_tokens, max_num_new_tokens, chunked)
        if n is None or self.blocks_needed(n) > len(self._free) - keep_free:
            return None
        self.allocate(seq.seq_id, n)
        return Admission(0, n)

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Create sequence ``seq_id`` with slots for ``num_tokens`` tokens (its prompt); return its table.

        ``num_tokens`` may be 0: the id is registered and blocks come with the first append.
        """
        self._check_new(seq_id, "seq_id")
        needed = self.blocks_needed(num_tokens)
        self._require(needed, f"allocate {num_tokens} tokens for sequence {seq_id!r}")
        self._tables[seq_id] = [self._take() for _ in range(needed)]
        self._num_tokens[seq_id] = num_tokens
        return list(self._tables[seq_id])

    def append_slot(self, seq_id: Hashable) -> CopyOnWrite | None:
        """Add one token slot to ``seq_id``; see :meth:`append_slots`."""
        return self.append_slots(seq_id, 1)

    def append_slots(self, seq_id: Hashable, num_tokens: int) -> CopyOnWrite | None:
        """Add ``num_tokens`` token slots to ``seq_id``, taking new blocks as the last one fills.

        Returns a :class:`CopyOnWrite` if the last block was shared and partially filled
        (so writing into it would change the other owners' tokens): it has been replaced
        in this sequence's table by a fresh block, and the caller must copy the K/V of
        ``src_block`` into ``dst_block`` before writing. Returns ``None`` otherwise.
        """
        needed = self._blocks_needed_to_append(seq_id, num_tokens)
        self._require(needed, f"append {num_tokens} tokens to sequence {seq_id!r}")
        table, n = self._tables[seq_id], self._num_tokens[seq_id]
        cow = None
        if num_tokens and self._needs_copy_on_write(table, n):
            src, dst = table[-1], self._take()
            self._ref_counts[src] -= 1  # still >= 1: another sequence owns it
            table[-1] = dst
            cow = CopyOnWrite(src, dst)
        for _ in range(self.blocks_needed(n + num_tokens) - len(table)):
            table.append(self._take())
        self._num_tokens[seq_id] = n + num_tokens
        return cow

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` a copy of ``parent_id`` that shares every block (no memory is taken)."""
        parent = self._table(parent_id, "parent_id")
        self._check_new(child_id, "child_id")
        for block in parent:
            self._ref_counts[block] += 1
        self._tables[child_id] = list(parent)
        self._num_tokens[child_id] = self._num_tokens[parent_id]

    def free(self, seq_id: Hashable) -> None:
        """Release ``seq_id``: drop one reference from each of its blocks; unshared blocks go back to the free list."""
        table = self._table(seq_id)
        # Reversed, as nano-vllm does: the tail of a sequence goes back first.
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        del self._tables[seq_id], self._num_tokens[seq_id]

    # ---- swapping (chapter 7) -----------------------------------------------
    def is_swapped(self, seq_id: Hashable) -> bool:
        return seq_id in self._swapped

    def can_swap_out(self, seq_id: Hashable) -> bool:
        """Whether the host pool can take all of ``seq_id``'s blocks (cold prefix blocks give way)."""
        return len(self._table(seq_id)) <= self.host.num_available_blocks

    def swap_out(self, seq_id: Hashable) -> list[BlockTransfer]:
        """Move ``seq_id``'s blocks to the host pool and free them here; the sequence keeps its tokens.

        A shared block is copied like a private one (each owner gets its own host copy).
        """
        table = self._table(seq_id)
        if len(table) > self.host.num_available_blocks:
            raise NoFreeBlocksError(
                f"cannot swap out {seq_id!r}: needs {len(table)} host blocks, "
                f"only {self.host.num_available_blocks} of {self.host.num_blocks} can be freed"
            )
        host_table = [self.host.take() for _ in table]
        moves = [BlockTransfer("to_host", block, host) for block, host in zip(table, host_table)]
        self._transfers += moves
        num_tokens = self._num_tokens[seq_id]
        self.free(seq_id)
        self._swapped[seq_id] = (host_table, num_tokens)
        return moves

    def blocks_to_swap_in(self, seq_id: Hashable, num_new_tokens: int = 0) -> int:
        """Free blocks :meth:`swap_in` would take, and appending ``num_new_tokens`` slots after it."""
        host_table, num_tokens = self._swapped_table(seq_id)
        return max(len(host_table), self.blocks_needed(num_tokens + check_int("num_new_tokens", num_new_tokens, min=0)))

    def swap_in(self, seq_id: Hashable) -> list[BlockTransfer]:
        """Bring a swapped sequence back into fresh blocks; its host blocks are freed."""
        host_table, num_tokens = self._swapped_table(seq_id)
        self._require(len(host_table), f"swap in sequence {seq_id!r}")
        table = [self._take() for _ in host_table]  # may record moves of its own (evictions): they go first
        moves = [BlockTransfer("to_device", host, block) for host, block in zip(host_table, table)]
        self._transfers += moves
        self.host.free(host_table)
        del self._swapped[seq_id]
        self._tables[seq_id], self._num_tokens[seq_id] = table, num_tokens
        return moves

    def free_swapped(self, seq_id: Hashable) -> None:
        """Drop a swapped sequence (aborted): its host blocks go back."""
        self.host.free(self._swapped_table(seq_id)[0])
        del self._swapped[seq_id]

    # ---- a step as a transaction ---------------------------------------------
    def snapshot(self) -> dict:
        """Everything the pool's calls change, copied: :meth:`restore` puts the pool back as it was.

        The scheduler takes one before each step and restores it if the step fails (a user's hook
        raised, the forward ran out of memory), so a failed step leaves no slot reserved. The copies
        are shallow where the entries are immutable: a few list and dict copies, no block data.
        """
        host = self.host.snapshot() if self.host.num_blocks else None  # an empty host pool never changes
        return {"_free": self._free.copy(), "_ref_counts": list(self._ref_counts),
                "_tables": {seq_id: list(t) for seq_id, t in self._tables.items()},
                "_num_tokens": dict(self._num_tokens), "_swapped": dict(self._swapped),
                "_transfers": list(self._transfers), "host": host}  # fmt: skip

    def restore(self, state: dict) -> None:
        """Put the pool back as it was when ``state`` (from :meth:`snapshot`) was taken."""
        state = dict(state)
        host = state.pop("host")
        if host is not None:
            self.host.restore(host)
        vars(self).update(state)

    def take_transfers(self) -> list[BlockTransfer]:
        """The block moves decided since the last call, in order; copy them before the next forward."""
        moves, self._transfers = self._transfers, []
        return moves

    # ---- internals ----------------------------------------------------------
    def _swapped_table(self, seq_id: Hashable) -> tuple[list[int], int]:
        try:
            return self._swapped[seq_id]
        except (KeyError, TypeError):
            raise ValueError(f"seq_id={seq_id!r} is not swapped out") from None

    def _table(self, seq_id: Hashable, name: str = "seq_id") -> list[int]:
        try:
            return self._tables[seq_id]
        except TypeError:
            raise TypeError(f"{name} must be hashable, got {type(seq_id).__name__}") from None
        except KeyError:
            raise ValueError(
                f"{name}={seq_id!r} is not an allocated sequence (never allocated, or already freed)"
            ) from None

    def _check_new(self, seq_id: Hashable, name: str) -> None:
        if not isinstance(seq_id, Hashable):
            raise TypeError(f"{name} must be hashable, got {type(seq_id).__name__}")
        if seq_id in self._tables or seq_id in self._swapped:
            raise ValueError(f"{name}={seq_id!r} is already allocated; free it first or pick a new id")

    def _needs_copy_on_write(self, table: list[int], num_tokens: int) -> bool:
        # Only a partially filled last block is ever written again; full blocks stay shared.
        return num_tokens % self.block_size != 0 and self._ref_counts[table[-1]] > 1

    def _blocks_needed_to_append(self, seq_id: Hashable, num_tokens: int) -> int:
        check_int("num_tokens", num_tokens, min=0)  # a sequence only grows; free() is how it shrinks
        table, n = self._table(seq_id), self._num_tokens[seq_id]
        new_blocks = self.blocks_needed(n + num_tokens) - len(table)
        return new_blocks + int(num_tokens > 0 and self._needs_copy_on_write(table, n))

    def _require(self, needed: int, what: str) -> None:
        # Checked before anything changes, so a failed call leaves no half-made sequence behind.
        if needed > len(self._free):
            raise NoFreeBlocksError(
                f"cannot {what}: needs {needed} free blocks, only {len(self._free)} of {self.num_blocks} are free"
            )

    def _take(self) -> int:
        block = self._free.popleft()
        self._ref_counts[block] = 1
        return block

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free_blocks}, seqs={len(self._tables)}, swapped={len(self._swapped)})"
        )
