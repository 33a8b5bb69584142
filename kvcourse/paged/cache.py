"""A paged KV cache the real model can run on: :class:`PagedKVCache` and :func:`generate_paged`.

It speaks the same two-member protocol as the contiguous :class:`kvcourse.KVCache`
(``seq_len`` and ``update``), so ``model(ids, cache=PagedKVCache(...))`` works unchanged.
Behind it, a :class:`BlockManager` hands out blocks and a :class:`PagedKVStore` holds the
K/V. One forward pass goes:

1. layer 0's ``update`` asks the manager for slots for the ``T`` new tokens (taking new
   blocks, or copying a shared block first: copy-on-write) and computes their slot mapping;
2. every layer scatters its new K/V into those slots, then gathers the whole sequence
   back through the block table for attention.

The gather makes a contiguous copy each step, which a real engine avoids by reading the
blocks inside the attention kernel (:func:`paged_attention_ref`, and chapter 5's Triton
version). Here it keeps the model untouched and the result exactly equal to the contiguous cache.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Iterable, Sequence

import torch

from ..generate import check_generation_args, pick_next_token
from .block_manager import BlockManager
from .kv_store import PagedKVStore

__all__ = ["PagedKVCache", "generate_paged"]


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
        self._slots: torch.Tensor | None = None  # slot mapping of the current forward's new tokens
        self._next_layer = 0  # layers must arrive 0, 1, ..., num_layers - 1 in every forward

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
        return cls(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=torch.float32 if dtype is None else dtype,
            device="cpu" if device is None else device,
        )

    # ---- what the model calls -------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens this sequence has slots for (read by the model before a forward: the tokens cached)."""
        return self.block_manager.num_tokens(self.seq_id)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [1, H_kv, T, D]`` for layer ``layer_idx``; return its K, V so far, ``[1, H_kv, S, D]``."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be an int in [0, {self.num_layers}), got {layer_idx!r}")
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise TypeError("k and v must be torch.Tensors [1, H_kv, T, D]")
        t = k.shape[2] if k.ndim == 4 else -1
        expected = (1, self.num_kv_heads, t, self.head_dim)
        if k.ndim != 4 or k.shape != expected or v.shape != expected:
            raise ValueError(
                f"k and v must have shape [1, H_kv, T, D] = [1, {self.num_kv_heads}, T, {self.head_dim}] "
                f"(PagedKVCache holds one sequence), got {list(k.shape)} and {list(v.shape)}"
            )
        if layer_idx != self._next_layer:
            raise ValueError(
                f"layers must be updated in order within a forward: expected layer {self._next_layer}, got {layer_idx}"
            )
        if layer_idx == 0:
            self._slots = self._append(t)  # layer 0 starts a forward: reserve slots for its tokens
        elif self._slots.numel() != t:
            raise ValueError(
                f"layer {layer_idx} got {t} new tokens but layer 0 of this forward had {self._slots.numel()}"
            )
        self._next_layer = (layer_idx + 1) % self.num_layers
        self.kv_store.write(layer_idx, self._slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        k_all, v_all = self.kv_store.gather(layer_idx, self.block_table, self.seq_len)
        return k_all.unsqueeze(0), v_all.unsqueeze(0)

    def _append(self, num_tokens: int) -> torch.Tensor:
        start = self.seq_len
        # Raises NoFreeBlocksError before changing anything if the pool is full.
        cow = self.block_manager.append_slots(self.seq_id, num_tokens)
        if cow is not None:
            # The last block was shared with a fork and is about to be written: give this
            # sequence its own copy of the tokens already in it (all layers at once).
            self.kv_store.copy_block(cow.src_block, cow.dst_block)
        slots = self.block_manager.slot_mapping(self.seq_id, start)
        return torch.tensor(slots, dtype=torch.int64, device=self.kv_store.device)

    # ---- sharing ----------------------------------------------------------------
    def fork(self, seq_id: Hashable | None = None) -> PagedKVCache:
        """A second cache for a child sequence sharing all of this one's blocks (parallel sampling).

        No K/V is copied now; whichever sequence first appends into the shared, partially
        filled last block gets its own copy of that one block.
        """
        if self._next_layer != 0:
            raise ValueError("fork() must be called between forward passes")
        seq_id = _unused_seq_id(self.block_manager) if seq_id is None else seq_id
        self.block_manager.fork(self.seq_id, seq_id)
        child = copy.copy(self)  # same shape, same block_manager and kv_store: only the id differs
        child.seq_id, child._slots, child._next_layer = seq_id, None, 0
        return child

    def free(self) -> None:
        """Give this sequence's blocks back to the pool (shared blocks stay with their other owners)."""
        self.block_manager.free(self.seq_id)
        self._slots, self._next_layer = None, 0

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


def generate_paged(
    model,
    ids: Sequence[int],
    max_new_tokens: int,
    cache: PagedKVCache | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> list[int]:
    """:func:`kvcourse.generate` through a :class:`PagedKVCache`: greedy by default, EOS included.

    ``ids`` are the tokens ``cache`` has not seen yet (the prompt for an empty cache, or a
    continuation for a forked one). Without a ``cache``, a pool just big enough is made.
    """
    ids = check_generation_args(model, ids, max_new_tokens, temperature)
    if cache is None:
        num_blocks = max(1, -(-(len(ids) + max_new_tokens) // 16))
        cache = PagedKVCache.for_model(model.config, num_blocks, 16, dtype=model.dtype, device=model.device)
    elif not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache or None, got {type(cache).__name__}")
    stop = set(model.config.eos_token_id if eos_token_ids is None else eos_token_ids)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(0 if seed is None else seed)
    out: list[int] = []
    next_input = ids  # prefill: everything the cache has not seen; then one token per step
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([next_input], device=model.device), cache=cache)
        token = pick_next_token(logits[0, -1].cpu(), temperature, generator)
        out.append(token)
        if token in stop:
            break
        next_input = [token]
    return out
