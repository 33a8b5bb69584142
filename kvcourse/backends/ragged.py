"""The ``"triton-ragged"`` backend: every row of a step, decodes and prompts alike, through one ragged kernel.

:class:`~kvcourse.backends.triton.TritonBackend` splits a step on the host into decode rows (the paged decode
kernel) and prompt rows (SDPA over a padded box), so its shapes follow the step. This backend does not split:
each layer writes the step's K/V to their slots, then :func:`~kvcourse.kernels.triton_ragged.ragged_paged` reads
every sequence's rows where the model packed them, with a grid fixed by the number of rows. Nothing about the
step's split into sequences is decided on the host, so a CUDA graph recorded for ``N`` rows replays any step of
at most ``N`` (:mod:`kvcourse.serving.step_graphs` records mixed steps with it).
"""

from __future__ import annotations

import torch

from ..batch import ForwardBatch
from . import register
from .paged import PagedBackend

__all__ = ["RaggedTritonBackend"]


@register("triton-ragged")
class RaggedTritonBackend(PagedBackend):
    """A ragged batch on a float paged pool: Triton's cache write, then one ragged attention kernel per layer.

    ``capturable``: it launches from shapes alone and reads nothing back from the device.
    """

    capturable = True

    def __init__(self, kv_pool, batch: ForwardBatch) -> None:
        # No split into decode and prefill rows (PagedBackend's): one kernel serves every row, and the split's
        # index tensors, made from host lists, could not be made while a graph records.
        self.attach(kv_pool, batch)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from ..kernels.triton_cache import reshape_and_cache
        from ..kernels.triton_ragged import ragged_paged, ragged_paged_attention_ref
        from ..kernels.triton_runtime import launch_or_fallback

        k_cache, v_cache, batch = self.pool.k_cache[layer_idx], self.pool.v_cache[layer_idx], self.batch
        reshape_and_cache(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, batch.slot_mapping, check=False)
        config = (q.dtype, q.shape[-1], q.shape[1] // k_cache.shape[2], k_cache.shape[1])
        args = (q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, self.scale)
        return launch_or_fallback(  # counted, so a recording sees a kernel that fell back (StepGraphs)
            "ragged_paged_attention",
            q.device,
            config,
            lambda: ragged_paged(*args),
            lambda: ragged_paged_attention_ref(*args),
        )
