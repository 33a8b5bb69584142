"""The ``"triton-int8"`` backend: the model on an int8 paged pool through chapter 5's int8 kernels.

:class:`~kvcourse.backends.int8.Int8PagedTorchBackend` with its write and its decode replaced, as the
float ``"triton"`` backend replaces them:

* ``write_kv``: new tokens are quantized and written, with their scales, by
  :func:`~kvcourse.kernels.triton_cache.reshape_and_cache_int8` (bit for bit the torch quantizer);
* ``decode``: one-token steps attend through :func:`~kvcourse.kernels.triton_paged.paged_decode_attention_int8`,
  which reads the int8 codes and dequantizes them in registers: half the bytes of fp16 from memory;
* ``prefill`` stays torch's, on the dequantized slots.

On a GPU this is the int8 path a server would run; on a CPU the kernels run in Triton's interpreter
(slow, for the tests). ``backend.runs`` and ``backend.fell_back`` as in :mod:`.triton`.
"""

from __future__ import annotations

import torch

from ..kernels.triton_cache import reshape_and_cache_int8
from ..kernels.triton_paged import paged_decode_attention_int8
from ..kernels.triton_runtime import counting_runs
from . import register
from .int8 import Int8PagedTorchBackend
from .triton import KernelSteps

__all__ = ["TritonInt8Backend"]


@register("triton-int8")
class TritonInt8Backend(KernelSteps, Int8PagedTorchBackend):
    """A ragged batch on an int8 paged pool, written and decoded by Triton kernels (prefill in torch)."""

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
