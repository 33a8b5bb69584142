"""Paged KV cache (chapter 4): a block allocator, block tables and slot mapping, as in vLLM.

* :mod:`.block_manager` -- :class:`BlockManager`: free list, reference counts, block tables,
  copy-on-write forks. Pure bookkeeping, no tensors.
"""

from .block_manager import BlockManager, CopyOnWrite, NoFreeBlocksError

__all__ = ["BlockManager", "CopyOnWrite", "NoFreeBlocksError"]
