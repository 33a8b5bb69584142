"""What a scheduler needs from its KV memory, written down: the :class:`KVPool` protocol.

The scheduler (chapter 6) decides who runs; the pool decides whether their tokens fit. They talk
through a few calls, the same for every pool: chapter 4's :class:`~kvcourse.paged.BlockManager`,
chapter 7's :class:`~kvcourse.paged.PrefixCachingBlockManager`, and the reservation allocators of
chapter 4's simulator (:class:`kvcourse.fragmentation.ReservationPool`). :class:`PagedKVPool` adds
what only block tables make possible: sharing blocks between forks, and moving them to a host pool;
:class:`PrefixCachingPool`, the cache of full blocks.

Admission is one question with one answer (:meth:`KVPool.admit`): *does this sequence fit, and how
many of its tokens are cached already?* The pool answers ``None`` (nothing changed) or allocates
and returns an :class:`Admission`: the scheduler does not count blocks to admit anyone, nor catch an
error to learn that they did not fit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence as SequenceABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # the pools never import torch, which kvcourse.sequence does
    from ..sequence import Sequence
    from .offload import BlockTransfer

__all__ = ["Admission", "CopyOnWrite", "KVPool", "PagedKVPool", "PrefixCachingPool"]


class Admission(NamedTuple):
    """A sequence admitted: ``num_cached_tokens`` found in the prefix cache (K/V reused, not fed),
    then ``num_new_tokens`` to feed this step (the rest of its tokens, or a chunk of them)."""

    num_cached_tokens: int
    num_new_tokens: int


# here, beside the protocol whose append_slots returns it, so the block manager and the protocol need not import each other
@dataclass(frozen=True)
class CopyOnWrite:
    """A copy-on-write that happened: the caller must copy block ``src_block``'s K/V into ``dst_block``."""

    src_block: int
    dst_block: int


@runtime_checkable
class KVPool(Protocol):
    """The calls a :class:`~kvcourse.serving.Scheduler` makes on its memory, in units of blocks.

    ``enable_prefix_caching``: admission looks up cached blocks, and the pool is a
    :class:`PrefixCachingPool`. ``num_host_blocks``: the host pool behind swap mode and the prefix
    cache's cold tier (0: none; more, and the pool is a :class:`PagedKVPool`).
    """

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool

    @property
    def num_host_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    def __contains__(self, seq_id: Hashable) -> bool: ...

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens of one sequence."""
        ...

    def admit(
        self,
        seq: Sequence,
        max_num_new_tokens: int,
        *,
        chunked: bool = True,
        keep_free: int = 0,
        cache_salt: str | None = None,
    ) -> Admission | None:
        """Give ``seq`` its slots if they fit, leaving ``keep_free`` blocks free: its cached prefix,
        then its other tokens (at most ``max_num_new_tokens`` of them when ``chunked``, else all or
        nothing). ``None`` if it does not fit: then nothing changed."""
        ...

    def append_slots(self, seq_id: Hashable, num_tokens: int) -> CopyOnWrite | None:
        """``num_tokens`` more slots for ``seq_id``, or raise ``NoFreeBlocksError`` changing nothing."""
        ...

    def free(self, seq_id: Hashable) -> None: ...


@runtime_checkable
class PagedKVPool(KVPool, Protocol):
    """A :class:`KVPool` on block tables: forks share blocks, full blocks can be cached, and blocks
    can move to a host pool and back (each move handed out by :meth:`take_transfers`)."""

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None: ...

    def can_swap_out(self, seq_id: Hashable) -> bool: ...

    def swap_out(self, seq_id: Hashable) -> list[BlockTransfer]: ...

    def blocks_to_swap_in(self, seq_id: Hashable, num_new_tokens: int = 0) -> int: ...

    def swap_in(self, seq_id: Hashable) -> list[BlockTransfer]: ...

    def free_swapped(self, seq_id: Hashable) -> None: ...

    def take_transfers(self) -> list[BlockTransfer]: ...


@runtime_checkable
class PrefixCachingPool(PagedKVPool, Protocol):
    """A :class:`PagedKVPool` whose full blocks outlive their sequences (``enable_prefix_caching``):
    after every forward, the scheduler reports how far each sequence's K/V are computed."""

    def cache_full_blocks(
        self, seq_id: Hashable, token_ids: SequenceABC[int], num_computed_tokens: int, cache_salt: str | None = None
    ) -> None: ...
