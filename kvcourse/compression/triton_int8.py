"""The ``"triton-int8"`` backend: the real model on an int8 paged pool through chapter 5's int8 kernels.

:class:`~kvcourse.compression.paged_int8.Int8PagedTorchBackend` with its write and its decode replaced,
as chapter 5's ``"triton"`` backend replaces the float ones:

* ``write_kv``: new tokens are quantized and written, with their scales, by
  :func:`~kvcourse.kernels.triton_cache.reshape_and_cache_int8` (bit for bit the torch quantizer);
* ``decode``: one-token steps attend through :func:`~kvcourse.kernels.triton_paged.paged_decode_attention_int8`,
  which reads the int8 codes and dequantizes them in registers: half the bytes of fp16 from memory;
* ``prefill`` stays the torch reference on the dequantized pool.

On a GPU this is the int8 path a server would run; on a CPU the kernels run in Triton's interpreter
(slow, for the tests). As in the float backend, ``backend.runs`` counts how each kernel ran in this
step and ``backend.fell_back`` names those the torch reference stood in for.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..kernels.triton_cache import reshape_and_cache_int8
from ..kernels.triton_paged import choose_num_splits, num_sms, paged_decode_attention_int8
from ..kernels.triton_runtime import check_kernel_device, counting_runs
from .paged_int8 import Int8PagedTorchBackend

__all__ = ["TritonInt8Backend"]


class TritonInt8Backend(Int8PagedTorchBackend):
    """A ragged batch on an int8 paged pool, written and decoded by Triton kernels (prefill in torch)."""

    def __init__(self, kv_pool, batch) -> None:
        super().__init__(kv_pool, batch)
        check_kernel_device("kv_pool", kv_pool.k_cache[0])
        self.runs: Counter = Counter()  # (kernel, how it ran) -> launches, this step
        self.num_splits = 1
        if self.decode_seqs:
            self.num_splits = choose_num_splits(len(self.decode_seqs), kv_pool.num_kv_heads, self.decode_max_len,
                                                num_sms(kv_pool.k_cache[0].device))  # fmt: skip

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pool = self.pool
        with counting_runs(self.runs):
            reshape_and_cache_int8(k, v, pool.k_cache[layer_idx], pool.v_cache[layer_idx], pool.k_scale[layer_idx],
                                   pool.v_scale[layer_idx], self.batch.slot_mapping)  # fmt: skip

    def decode(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        pool = self.pool
        with counting_runs(self.runs):
            return paged_decode_attention_int8(q, pool.k_cache[layer_idx], pool.v_cache[layer_idx],
                                               pool.k_scale[layer_idx], pool.v_scale[layer_idx], self.decode_tables,
                                               self.decode_lens, self.scale, self.num_splits)  # fmt: skip

    @property
    def fell_back(self) -> list[str]:
        """The kernels that could not compile in this step (the torch reference computed their results)."""
        return sorted({kernel for kernel, how in self.runs if how == "fallback"})
