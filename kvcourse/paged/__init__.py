"""Paged KV cache (chapter 4): a block allocator, block tables and slot mapping, as in vLLM.

* :mod:`.block_manager` -- :class:`BlockManager`: free list, reference counts, block tables,
  copy-on-write forks. Pure bookkeeping, no tensors.
* :mod:`.kv_store` -- :func:`slot_mapping`, :class:`PagedKVStore` (the block pool, one
  ``[num_blocks, block_size, H_kv, D]`` K and V tensor per layer) and :func:`paged_attention_ref`.
* :mod:`.cache` -- :class:`PagedKVCache`, which the real model runs on, and :func:`generate_paged`.
"""

from .block_manager import BlockManager, CopyOnWrite, NoFreeBlocksError
from .cache import PagedKVCache, generate_paged
from .kv_store import PagedKVStore, paged_attention_ref, slot_mapping

__all__ = [
    "BlockManager",
    "CopyOnWrite",
    "NoFreeBlocksError",
    "PagedKVCache",
    "PagedKVStore",
    "generate_paged",
    "paged_attention_ref",
    "slot_mapping",
]
