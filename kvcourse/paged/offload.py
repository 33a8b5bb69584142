"""KV offloading (chapter 7): a second, slower pool of blocks in host (CPU) memory.

GPU memory is the scarce tier; host memory is several times larger and reachable over PCIe. Two uses:

* **Swap** (the vLLM paper's alternative to recompute): a preempted sequence's blocks are copied to
  the host pool and its GPU blocks freed; when room comes back they are copied into fresh GPU blocks
  and the sequence carries on where it stopped, nothing recomputed.
* **A cold tier for the prefix cache** (vLLM's CPU offloading, SGLang's HiCache, LMCache): a cached
  block evicted from the GPU keeps its K/V in the host pool; a later request whose prefix reaches it
  copies it back instead of computing it again.

Both share one :class:`HostBlockPool`: swapped blocks are held until their sequence comes back;
cold blocks are a cache, evicted least recently used first when space is needed. This module only
does bookkeeping and the copies; :class:`~kvcourse.paged.BlockManager` decides what moves, and
records each move as a :class:`BlockTransfer`. The model runner replays the step's transfers **in
the order they were decided**, before the forward: then every copy reads exactly the data the
bookkeeping saw, even when a block freed by one move is taken by the next one in the same step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..checks import check_int
from .block_hash import CachedBlock

if TYPE_CHECKING:
    from .kv_store import PagedKVStore

__all__ = ["BlockTransfer", "HostBlockPool", "OffloadedBlock", "apply_transfers"]


@dataclass(frozen=True)
class BlockTransfer:
    """One block's K/V to copy: ``"to_host"`` from device block ``src`` to host block ``dst``, or
    ``"to_device"`` from host block ``src`` to device block ``dst``."""

    direction: Literal["to_host", "to_device"]
    src: int
    dst: int


@dataclass(frozen=True)
class OffloadedBlock:
    """A prefix-cache hit that sits in the host pool (block ``host_block``): it needs a device block
    and a copy before it can be used. :meth:`PrefixCachingBlockManager.find_cached_blocks` returns
    these after the device hits when a host pool is present."""

    host_block: int


class HostBlockPool:
    """Bookkeeping of the host blocks: a free list, and the cold prefix blocks in LRU order.

    Args:
        num_blocks: host blocks (0: no host pool).
    """

    def __init__(self, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks, min=0)
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cold: OrderedDict[int, CachedBlock] = OrderedDict()  # least recently used first
        self._cold_by_hash: dict[Hashable, dict[int, CachedBlock]] = {}
        self.num_evictions = 0  # cold blocks dropped to make room

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cold_blocks(self) -> int:
        return len(self._cold)

    @property
    def num_available_blocks(self) -> int:
        """Blocks :meth:`take` can hand out: free ones, then cold ones (evicted)."""
        return len(self._free) + len(self._cold)

    def take(self) -> int:
        """A host block for new data: a free one, else the least recently used cold one (evicted)."""
        if self._free:
            return self._free.popleft()
        if not self._cold:
            raise RuntimeError("the host pool is full of swapped blocks")  # callers check num_available_blocks
        block, entry = self._cold.popitem(last=False)
        self._forget(block, entry)
        self.num_evictions += 1
        return block

    def snapshot(self) -> dict:
        """Everything the pool's calls change, copied, for :meth:`restore` (the entries are immutable)."""
        return {
            "_free": self._free.copy(),
            "_cold": self._cold.copy(),
            "_cold_by_hash": dict(self._cold_by_hash),  # buckets are replaced, never changed in place
            "num_evictions": self.num_evictions,
        }

    def restore(self, state: dict) -> None:
        vars(self).update(state)

    def free(self, blocks: Sequence[int]) -> None:
        """Give back host blocks a swapped sequence held."""
        self._free.extend(blocks)

    def put_cold(self, entry: CachedBlock) -> int | None:
        """Keep ``entry``'s block in the cold tier; its host block, or ``None`` if nothing can be freed."""
        if not self.num_available_blocks:
            return None
        block = self.take()
        self._cold[block] = entry
        bucket = self._cold_by_hash.get(entry.block_hash, {})
        self._cold_by_hash[entry.block_hash] = {**bucket, block: entry}  # replaced, not changed: see snapshot()
        return block

    def find_cold(
        self, block_hash: Hashable, token_ids: tuple[int, ...], extra_keys: tuple, parent: CachedBlock | None
    ) -> int | None:
        """The cold block that holds this block (hash found, contents verified), or ``None``."""
        candidates = self._cold_by_hash.get(block_hash, {})
        return next((b for b, e in candidates.items() if e.holds(token_ids, extra_keys, parent)), None)

    def is_cold(self, block: int) -> bool:
        return block in self._cold

    def cold_entry(self, block: int) -> CachedBlock:
        return self._cold[block]

    def pop_cold(self, block: int) -> CachedBlock:
        """Take ``block``'s entry out of the cold tier (it moves back to the device). The block stays
        held until its copy is recorded: the caller gives it back with :meth:`free`."""
        entry = self._cold.pop(block)
        self._forget(block, entry)
        return entry

    def clear_cold(self) -> int:
        """Forget every cold block; return how many."""
        n = len(self._cold)
        for block, entry in list(self._cold.items()):
            self._forget(block, entry)
            self._free.append(block)
        self._cold.clear()
        return n

    def _forget(self, block: int, entry: CachedBlock) -> None:
        bucket = {b: e for b, e in self._cold_by_hash[entry.block_hash].items() if b != block}
        if bucket:
            self._cold_by_hash[entry.block_hash] = bucket
        else:
            del self._cold_by_hash[entry.block_hash]

    def __repr__(self) -> str:
        return f"HostBlockPool(num_blocks={self.num_blocks}, free={self.num_free_blocks}, cold={self.num_cold_blocks})"


def apply_transfers(device_store: PagedKVStore, host_store: PagedKVStore, transfers: Sequence[BlockTransfer]) -> None:
    """Copy the K/V of every transfer, in order, between the device pool and the host pool.

    Consecutive transfers in the same direction go as one batched copy per layer (vLLM's
    ``swap_blocks``): many small copies cost far more than one large one over PCIe. A batch stops
    where a block would be written twice, so the order of the moves is kept.
    """
    import torch  # the one data-plane function here: the bookkeeping above imports no torch

    i = 0
    while i < len(transfers):
        direction, written, j = transfers[i].direction, set(), i
        while j < len(transfers) and transfers[j].direction == direction and transfers[j].dst not in written:
            written.add(transfers[j].dst)
            j += 1
        src_store, dst_store = (device_store, host_store) if direction == "to_host" else (host_store, device_store)
        src = torch.tensor([t.src for t in transfers[i:j]], dtype=torch.int64, device=src_store.device)
        dst = torch.tensor([t.dst for t in transfers[i:j]], dtype=torch.int64, device=dst_store.device)
        for layer in range(device_store.num_layers):
            for s, d in (
                (src_store.k_cache[layer], dst_store.k_cache[layer]),
                (src_store.v_cache[layer], dst_store.v_cache[layer]),
            ):
                # Synchronous on purpose: the next move or the forward may touch these blocks. (vLLM copies
                # from pinned host memory asynchronously and waits on a CUDA event before the forward.)
                d.index_copy_(0, dst, s.index_select(0, src).to(d.device))
        i = j
