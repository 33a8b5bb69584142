"""The block pool: per layer, one K and one V tensor of ``[num_blocks, block_size, H_kv, D]``.

vLLM's layout, token-major inside a block. Viewed flat, a layer's pool is ``num_blocks *
block_size`` token **slots**; a token's K/V go to the slot :func:`kvcourse.batch.slot_mapping`
gives for its position, and attention reads them back through the block table
(:func:`kvcourse.kernels.paged_decode_attention_ref`), block by block, without copying the
sequence out first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..checks import check_fits_in_memory, check_float_dtype, check_int, check_ints
from ..kernels.reference import reshape_and_cache_ref
from ..utils import check_config

__all__ = ["PagedKVStore"]


class PagedKVStore:
    """The K/V of every sequence, in blocks. It knows nothing about sequences: a
    :class:`~kvcourse.paged.BlockManager` decides which blocks each one uses.

    Args:
        num_layers, num_kv_heads, head_dim: the model's KV shape.
        num_blocks, block_size: the pool, allocated up front as vLLM does at start-up.
        dtype, device: of the tensors.
    """

    format = "float"  # what a block holds (chapter 8's int8 store holds codes and scales)

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        check_ints(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                   head_dim=head_dim)  # fmt: skip
        check_float_dtype("dtype", dtype)
        num_layers, num_blocks, block_size = int(num_layers), int(num_blocks), int(block_size)
        num_kv_heads, head_dim = int(num_kv_heads), int(head_dim)
        nbytes = 2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize
        check_fits_in_memory("num_blocks", nbytes, device, f"a pool of {num_blocks:,} blocks of {block_size} tokens")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros rather than empty: a bug that reads an unwritten slot then gives a visible
        # wrong answer in tests instead of whatever bytes were in memory.
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(
        cls,
        config,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> PagedKVStore:
        """A pool shaped for ``config`` (a :class:`kvcourse.LlamaConfig`)."""
        check_config(config)
        return cls(
            config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim, dtype, device
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.k_cache[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k_cache[0].device

    @property
    def block_nbytes(self) -> int:
        """Bytes one block holds across all layers, K and V: 2 x layers x block_size x H_kv x D x itemsize."""
        return 2 * self.num_layers * self.k_cache[0][0].nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_blocks * self.block_nbytes

    def write(self, layer_idx: int, slots: torch.Tensor | Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter new tokens' ``k, v [T, H_kv, D]`` into ``slots [T]`` of layer ``layer_idx`` (checked)."""
        check_int("layer_idx", layer_idx, min=0, max=self.num_layers - 1)
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        reshape_and_cache_ref(k, v, self.k_cache[layer_idx], self.v_cache[layer_idx], slots)

    def copy_block(self, src_block: int, dst_block: int) -> None:
        """Copy-on-write: duplicate block ``src_block``'s K/V into ``dst_block`` in every layer."""
        for name, b in (("src_block", src_block), ("dst_block", dst_block)):
            check_int(name, b, min=0, max=self.num_blocks - 1)
        for k_cache, v_cache in zip(self.k_cache, self.v_cache):
            k_cache[dst_block] = k_cache[src_block]
            v_cache[dst_block] = v_cache[src_block]

    def __repr__(self) -> str:
        return (
            f"PagedKVStore(layers={self.num_layers}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, nbytes={self.nbytes:,})"
        )
