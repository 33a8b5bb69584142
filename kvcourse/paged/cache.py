"""One sequence on a paged pool (:class:`PagedKVCache`), and the step before every forward (:func:`allocate_slots`).

A forward pass on a paged pool never allocates. Before it runs, the caller

1. asks the :class:`BlockManager` for slots for the step's new tokens (:func:`allocate_slots`), which
   may take new blocks and, if the sequence's last block is shared with a fork, give it a private
   copy: the K/V of that block are copied right then (**copy-on-write**), in every layer;
2. describes the step in a :class:`~kvcourse.batch.ForwardBatch` (positions, slot mapping, block tables);
3. runs ``model.forward_batch(batch, kv_store)``: each layer writes its new K/V into the slots and
   attends by reading the blocks in place through the block table.

:class:`PagedKVCache` does steps 1-2 for a single sequence (``cache.prepare(token_ids)``), which is
all chapter 4 needs; chapter 6's scheduler does them for a whole batch with the same function.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence

import torch

from ..batch import ForwardBatch, SeqSlice
from ..utils import check_config
from .block_manager import BlockManager
from .kv_store import PagedKVStore

__all__ = ["PagedKVCache", "allocate_slots"]


def allocate_slots(block_manager: BlockManager, kv_store: PagedKVStore, seq_id: Hashable, num_new_tokens: int) -> int:
    """Reserve slots for ``num_new_tokens`` more tokens of ``seq_id``; return the first new token's position.

    Raises :class:`~kvcourse.paged.NoFreeBlocksError` (changing nothing) if the pool is too full.
    """
    start = block_manager.num_tokens(seq_id)
    cow = block_manager.append_slots(seq_id, num_new_tokens)
    if cow is not None:
        # The last block was shared with a fork and is about to be written: this sequence gets its
        # own copy of the tokens already in it (all layers at once), before anything writes.
        kv_store.copy_block(cow.src_block, cow.dst_block)
    return start


def _unused_seq_id(block_manager: BlockManager) -> int:
    used = set(block_manager.seq_ids)
    return next(i for i in range(len(used) + 1) if i not in used)


class PagedKVCache:
    """One sequence (batch size 1) whose K/V live in blocks of a shared pool.

    Args:
        num_layers, num_kv_heads, head_dim: the model's KV shape (or use :meth:`for_model`).
        num_blocks, block_size: size of a new pool; ignored when ``block_manager`` and
            ``kv_store`` are given.
        dtype, device: of a new pool's tensors.
        block_manager, kv_store: an existing pool to share with other caches (give both).
        seq_id: this sequence's id in the manager; default: the smallest unused int.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int = 64,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        block_manager: BlockManager | None = None,
        kv_store: PagedKVStore | None = None,
        seq_id: Hashable | None = None,
    ) -> None:
        if (block_manager is None) != (kv_store is None):
            raise ValueError("block_manager and kv_store must be given together (a pool is both)")
        if block_manager is None:
            block_manager = BlockManager(num_blocks, block_size)
            kv_store = PagedKVStore(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        if not isinstance(block_manager, BlockManager):
            raise TypeError(f"block_manager must be a BlockManager, got {type(block_manager).__name__}")
        if not isinstance(kv_store, PagedKVStore):
            raise TypeError(f"kv_store must be a PagedKVStore, got {type(kv_store).__name__}")
        store_shape = (kv_store.num_layers, kv_store.num_kv_heads, kv_store.head_dim)
        if store_shape != (num_layers, num_kv_heads, head_dim):
            raise ValueError(
                f"kv_store holds (layers, kv_heads, head_dim) = {store_shape}, "
                f"the cache was asked for {(num_layers, num_kv_heads, head_dim)}"
            )
        if (kv_store.num_blocks, kv_store.block_size) != (block_manager.num_blocks, block_manager.block_size):
            raise ValueError("kv_store and block_manager must agree on num_blocks and block_size")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_manager, self.kv_store = block_manager, kv_store
        seq_id = _unused_seq_id(block_manager) if seq_id is None else seq_id
        block_manager.allocate(seq_id, 0)  # registers the id; blocks come with the first tokens
        self.seq_id = seq_id

    @classmethod
    def for_model(
        cls,
        config,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> PagedKVCache:
        """A cache with a fresh pool of ``num_blocks`` blocks shaped for ``config`` (a LlamaConfig)."""
        check_config(config)
        return cls(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=torch.float32 if dtype is None else dtype,
            device="cpu" if device is None else device,
        )

    # ---- before each forward ----------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens this sequence has slots for: the tokens cached once the last prepared step has run."""
        return self.block_manager.num_tokens(self.seq_id)

    def prepare(self, token_ids: Sequence[int]) -> ForwardBatch:
        """Allocate slots for ``token_ids`` (the sequence's next tokens) and describe the step.

        Run it with ``model.forward_batch(batch, cache.kv_store)``.
        """
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence) or not token_ids:
            raise ValueError(f"token_ids must be a non-empty list of token ids, got {token_ids!r}")
        start = allocate_slots(self.block_manager, self.kv_store, self.seq_id, len(token_ids))
        seq = SeqSlice(list(token_ids), start, self.block_table)
        return ForwardBatch.build([seq], self.block_size, self.kv_store.device)

    # ---- sharing ----------------------------------------------------------------
    def fork(self, seq_id: Hashable | None = None) -> PagedKVCache:
        """A second cache for a child sequence sharing all of this one's blocks (parallel sampling).

        No K/V is copied now; whichever sequence first appends into the shared, partially
        filled last block gets its own copy of that one block.
        """
        seq_id = _unused_seq_id(self.block_manager) if seq_id is None else seq_id
        self.block_manager.fork(self.seq_id, seq_id)
        child = copy.copy(self)  # same shape, same block_manager and kv_store: only the id differs
        child.seq_id = seq_id
        return child

    def free(self) -> None:
        """Give this sequence's blocks back to the pool (shared blocks stay with their other owners)."""
        self.block_manager.free(self.seq_id)

    # ---- what readers look at -------------------------------------------------
    @property
    def block_table(self) -> list[int]:
        """Physical block ids holding this sequence's tokens, in order."""
        return self.block_manager.block_table(self.seq_id)

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def num_free_blocks(self) -> int:
        """Free blocks left in the (possibly shared) pool."""
        return self.block_manager.num_free_blocks

    @property
    def nbytes(self) -> int:
        """Bytes of K and V for the live tokens: 2 x layers x seq_len x H_kv x D x itemsize (as ``KVCache.nbytes``)."""
        return self.seq_len * self.kv_store.block_nbytes // self.block_size

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of the blocks in this sequence's table (shared blocks counted in full)."""
        return len(self.block_table) * self.kv_store.block_nbytes

    def __len__(self) -> int:
        return self.seq_len

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(seq_id={self.seq_id!r}, seq_len={self.seq_len}, block_size={self.block_size}, "
            f"block_table={self.block_table}, free_blocks={self.num_free_blocks})"
        )
