"""Paged KV cache (chapter 4): a block allocator, a block pool, and one sequence on it, as in vLLM.

* :mod:`.block_manager` -- :class:`BlockManager`: free list, reference counts, block tables,
  copy-on-write forks. Pure bookkeeping, no tensors.
* :mod:`.kv_store` -- :class:`PagedKVStore`, the block pool: one ``[num_blocks, block_size, H_kv, D]``
  K and V tensor per layer.
* :mod:`.cache` -- :func:`allocate_slots` (what happens before every forward) and
  :class:`PagedKVCache`, one sequence on a pool.

The slot-mapping formula is :func:`kvcourse.batch.slot_mapping`; paged attention is in
:mod:`kvcourse.kernels`; the real model runs a paged step with ``model.forward_batch``.
"""

from ..batch import slot_mapping
from .block_manager import BlockManager, CopyOnWrite, NoFreeBlocksError
from .cache import PagedKVCache, allocate_slots
from .kv_store import PagedKVStore

__all__ = [
    "BlockManager",
    "CopyOnWrite",
    "NoFreeBlocksError",
    "PagedKVCache",
    "PagedKVStore",
    "allocate_slots",
    "slot_mapping",
]
