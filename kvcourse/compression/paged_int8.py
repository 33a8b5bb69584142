"""Chapter 4's paged pool stored in int8.

Per layer, vLLM's layout with a scale beside every cached vector, exactly what chapter 5's int8
kernels write and read (:mod:`kvcourse.kernels.int8`, whose quantizer this module uses):

    k_cache, v_cache   int8      [num_blocks, block_size, H_kv, D]
    k_scale, v_scale   float32   [num_blocks, block_size, H_kv]        one per token and head

**Symmetric** quantization, ``x = code * scale`` with ``scale = max|x| / 127`` and codes in
``-127 .. 127``: no zero point, so a kernel dequantizes with one multiply per value. A token costs
``D + 4`` bytes per head instead of ``2 D`` in fp16.

The ``"paged-int8-torch"`` backend (:mod:`kvcourse.backends.int8`, ``model.forward_batch(batch, store,
backend="paged-int8-torch")``) quantizes each new token as it is written and dequantizes what it reads:
the reference the kernel must equal. With a GPU, ``backend="triton-int8"`` writes and decodes through
chapter 5's kernels instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..checks import check_int, check_ints
from ..kernels.int8 import dequantize_int8, quantize_int8
from ..paged.kv_store import PagedKVStore
from ..utils import check_config

__all__ = ["Int8PagedKVStore", "dequantize_int8", "quantize_int8"]

SCALE_DTYPE = torch.float32  # chapter 5's kernels read fp32 scales


class Int8PagedKVStore(PagedKVStore):
    """A :class:`~kvcourse.paged.PagedKVStore` whose blocks hold int8 codes and per-token, per-head scales."""

    format = "int8"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        check_ints(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                   head_dim=head_dim)  # fmt: skip
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(num_layers)]
        self.k_scale = [torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(
        cls, config, num_blocks: int, block_size: int = 16, device: torch.device | str = "cpu"
    ) -> Int8PagedKVStore:
        """A pool shaped for ``config`` (``model.config``)."""
        check_config(config)
        return cls(
            config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim, device
        )

    @property
    def block_nbytes(self) -> int:
        """Bytes one block holds across all layers, K and V: codes and scales."""
        return 2 * self.num_layers * (self.k_cache[0][0].nbytes + self.k_scale[0][0].nbytes)

    def write(self, layer_idx: int, slots: torch.Tensor | Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize new tokens' ``k, v [T, H_kv, D]`` and scatter them into ``slots [T]`` of layer ``layer_idx``."""
        check_int("layer_idx", layer_idx, min=0, max=self.num_layers - 1)
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        expected = (slots.shape[0], self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(
                f"k and v must have shape [T, H_kv, D] = {list(expected)}, got {list(k.shape)} and {list(v.shape)}"
            )
        if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < self.num_blocks * self.block_size):
            raise ValueError(f"slots must lie in [0, {self.num_blocks * self.block_size}), got {slots.tolist()[:5]}")
        self.write_unchecked(layer_idx, slots, k, v)

    def write_unchecked(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for x, cache, scales in (
            (k, self.k_cache[layer_idx], self.k_scale[layer_idx]),
            (v, self.v_cache[layer_idx], self.v_scale[layer_idx]),
        ):
            codes, scale = quantize_int8(x)
            cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, codes)
            scales.view(-1, self.num_kv_heads).index_copy_(0, slots, scale)

    def dequantized(self, layer_idx: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s whole pool as floats ``[num_blocks, block_size, H_kv, D]`` (for the reference)."""
        return (
            dequantize_int8(self.k_cache[layer_idx], self.k_scale[layer_idx], dtype),
            dequantize_int8(self.v_cache[layer_idx], self.v_scale[layer_idx], dtype),
        )

    def copy_block(self, src_block: int, dst_block: int) -> None:
        """Copy-on-write: duplicate block ``src_block`` (codes and scales) into ``dst_block`` in every layer."""
        super().copy_block(src_block, dst_block)
        for k_scale, v_scale in zip(self.k_scale, self.v_scale):
            k_scale[dst_block] = k_scale[src_block]
            v_scale[dst_block] = v_scale[src_block]

    def __repr__(self) -> str:
        return (
            f"Int8PagedKVStore(layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"nbytes={self.nbytes:,})"
        )
