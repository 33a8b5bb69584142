"""Paged KV cache (chapter 4): a block allocator, a block pool, and one sequence on it, as in vLLM.

* :mod:`.pool` -- :class:`KVPool`, the protocol a scheduler talks to its memory through (admission
  in one call), and :class:`PagedKVPool` / :class:`PrefixCachingPool`, what block tables add.
* :mod:`.block_manager` -- :class:`BlockManager`: free list, reference counts, block tables,
  copy-on-write forks. Pure bookkeeping, no tensors.
* :mod:`.block_hash` -- :func:`hash_block_tokens` and :class:`CachedBlock` (chapter 7): what
  identifies a full block's contents, its whole prefix included.
* :mod:`.prefix_cache` -- :class:`PrefixCachingBlockManager` (chapter 7): full blocks found again by
  chained block hashes, verified, shared; idle ones evicted least recently used first.
* :mod:`.radix` -- :class:`RadixCache` (chapter 7): SGLang's token-level radix tree, the other way to
  find a cached prefix, with LRU eviction at the leaves; :func:`longest_prefix_first` orders a queue by it.
* :mod:`.offload` -- :class:`HostBlockPool` (chapter 7): host-memory blocks for swapped sequences
  and a cold tier of evicted cached blocks; :func:`apply_transfers` copies the blocks.
* :mod:`.kv_store` -- :class:`PagedKVStore`, the block pool: one ``[num_blocks, block_size, H_kv, D]``
  K and V tensor per layer.
* :mod:`.cache` -- :func:`allocate_slots` (what happens before every forward) and
  :class:`PagedKVCache`, one sequence on a pool.

The slot-mapping formula is :func:`kvcourse.batch.slot_mapping`; paged attention is in
:mod:`kvcourse.kernels`; the real model runs a paged step with ``model.forward_batch``.
"""

from ..lazy import lazy_exports

_EXPORTS = {  # name -> the submodule that defines it, imported when the name is first read
    "slot_mapping": "..batch",
    "BlockManager": ".block_manager",
    "NoFreeBlocksError": ".block_manager",
    "PagedKVCache": ".cache",
    "allocate_slots": ".cache",
    "PagedKVStore": ".kv_store",
    "BlockTransfer": ".offload",
    "HostBlockPool": ".offload",
    "OffloadedBlock": ".offload",
    "apply_transfers": ".offload",
    "CachedBlock": ".block_hash",
    "hash_block_tokens": ".block_hash",
    "Admission": ".pool",
    "CopyOnWrite": ".pool",
    "KVPool": ".pool",
    "PagedKVPool": ".pool",
    "PrefixCachingPool": ".pool",
    "FreeBlockQueue": ".prefix_cache",
    "PrefixCachingBlockManager": ".prefix_cache",
    "RadixCache": ".radix",
    "longest_prefix_first": ".radix",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
