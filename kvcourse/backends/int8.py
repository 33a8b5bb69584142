"""The ``"paged-int8-torch"`` backend: the model on chapter 8's int8 pool, in torch.

:class:`~kvcourse.backends.paged.PagedTorchBackend` on an :class:`~kvcourse.compression.Int8PagedKVStore`,
with its two pool hooks replaced and nothing else: ``write_kv`` quantizes each new token (a scale per
token and head) as it is written; ``read_kv`` dequantizes exactly the slots the step reads. This is the
reference chapter 5's int8 kernels (``"triton-int8"``) must equal.
"""

from __future__ import annotations

import torch

from ..compression.paged_int8 import Int8PagedKVStore
from ..kernels.int8 import dequantize_int8
from . import register
from .paged import PagedTorchBackend

__all__ = ["Int8PagedTorchBackend"]


@register("paged-int8-torch")
class Int8PagedTorchBackend(PagedTorchBackend):
    """The paged-torch backend on an int8 pool: quantize on write, dequantize what is read."""

    store_type = Int8PagedKVStore

    @classmethod
    def make_store(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> Int8PagedKVStore:
        # The pool holds int8 codes whatever the model's dtype; reads dequantize to the queries' dtype.
        return Int8PagedKVStore.for_model(config, num_blocks, block_size, device)

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.write_unchecked(layer_idx, self.batch.slot_mapping, k, v)

    def read_kv(self, layer_idx: int, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.pool
        return (dequantize_int8(pool.k_cache[layer_idx].index_select(0, blocks),
                                pool.k_scale[layer_idx].index_select(0, blocks), dtype),
                dequantize_int8(pool.v_cache[layer_idx].index_select(0, blocks),
                                pool.v_scale[layer_idx].index_select(0, blocks), dtype))  # fmt: skip
