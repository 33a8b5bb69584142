"""The ``"triton"`` backend: the real model's cache writes and decode steps through chapter 5's kernels.

:class:`~kvcourse.backends.paged.PagedTorchBackend` with two of its three operations replaced:

* ``write_kv``: the new tokens' K/V go to their slots through :func:`~kvcourse.kernels.triton_cache.reshape_and_cache`;
* ``decode``: the sequences with one new token attend through the paged kernel
  (:func:`~kvcourse.kernels.triton_paged.paged_decode`), with the number of KV splits chosen once per step; or, when
  the batch carries a split plan (``batch.split_plan``, :class:`~kvcourse.kernels.split_plan.SplitPlan`, filled from
  the step's real lengths), through :func:`~kvcourse.kernels.triton_paged.paged_decode_planned`, whose launch does
  not depend on the lengths: a CUDA graph recorded once splits every replayed step as its own lengths need;
* a step of one-token sequences only (``all_decode``: every CUDA graph's decode step) does all three in one kernel a
  layer, :func:`~kvcourse.kernels.triton_fused_decode.rope_cache_decode`: RoPE of q and k, the cache write and
  the planned paged attention with its merge (``applies_rope``: the model hands it the unrotated QKV projection and
  the whole RoPE tables, :meth:`TritonBackend.attend_qkv`). Three launches a layer fewer (with the embedding fused
  with the first norm, 249 a step, not 342: ``python -m kvcourse.bench.launch_count``);
* ``prefill`` (a prompt, or a chunk of one) stays torch's SDPA: a prefill is compute-bound matrix
  multiplication, a different kernel (FlashAttention's), outside chapter 5.

The step's metadata was validated when the :class:`~kvcourse.batch.ForwardBatch` was built, so the
kernels launch without checks and without asking the device for anything.

``backend.runs`` counts how each kernel ran in this step (``(kernel, "compiled" | "interpreter" |
"fallback") -> launches``), and ``backend.fell_back`` names the kernels the torch reference stood in for:
a kernel that cannot compile here falls back with a warning, never silently.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..kernels.fused import rope
from ..kernels.split_plan import SplitPlan, plan_capacity
from ..kernels.triton_cache import reshape_and_cache
from ..kernels.triton_fused_decode import rope_cache_decode, rope_cache_decode_ref
from ..kernels.triton_paged import choose_num_splits, num_sms, paged_decode, paged_decode_planned
from ..kernels.triton_runtime import check_kernel_device, counting_runs, launch_or_fallback
from . import register
from .paged import PagedTorchBackend

__all__ = ["KernelSteps", "TritonBackend"]


class KernelSteps:
    """What the Triton backends add to a torch one: a kernel device check, the step's KV split
    count, and the count of how each kernel ran."""

    def __init__(self, kv_pool, batch) -> None:
        super().__init__(kv_pool, batch)
        check_kernel_device("kv_pool", kv_pool.k_cache[0])
        self.runs: Counter = Counter()  # (kernel, how it ran) -> launches, this step
        self.num_splits = 1
        if self.decode_seqs:
            self.num_splits = choose_num_splits(
                len(self.decode_seqs), kv_pool.num_kv_heads, self.decode_max_len, num_sms(kv_pool.k_cache[0].device)
            )

    @property
    def fell_back(self) -> list[str]:
        """The kernels that could not compile in this step (the torch reference computed their results)."""
        return sorted({kernel for kernel, how in self.runs if how == "fallback"})


@register("triton")
class TritonBackend(KernelSteps, PagedTorchBackend):
    """A ragged batch on a paged pool, written and decoded by Triton kernels (prefill in torch).

    ``capturable``: a decode-only step launches its kernels without reading anything back from the device
    and takes its shapes from the host, so a CUDA graph can record it (:mod:`kvcourse.serving.step_graphs`).
    """

    capturable = True
    fuse_attention = True  # False: the unfused launches in every step (to count or time one against the other)

    def __init__(self, kv_pool, batch) -> None:
        super().__init__(kv_pool, batch)
        # A step of one-token sequences rotates, stores and attends in one kernel a layer, reading its split-KV work
        # from a plan: the graph's (refilled each step), or one made here from the step's lengths.
        self.applies_rope = self.fuse_attention and self.all_decode and bool(self.decode_seqs)
        self.plan = batch.split_plan
        if self.applies_rope and self.plan is None:
            hkv, sms = kv_pool.num_kv_heads, num_sms(kv_pool.k_cache[0].device)
            self.plan = SplitPlan(plan_capacity(batch.num_seqs, hkv, sms), batch.num_seqs, batch.input_ids.device)
            self.plan.fill(list(batch.seq_lens_host), hkv, sms)

    def attend_qkv(self, layer_idx: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A decode step's attention from the packed, unrotated ``qkv [B, Hq + 2 Hkv, D]`` and the model's whole
        RoPE tables ``cos, sin [L, D]`` (signed sin): RoPE, the cache write and attention, one launch."""
        k_cache, v_cache = self.pool.k_cache[layer_idx], self.pool.v_cache[layer_idx]
        positions, hkv = self.batch.positions, k_cache.shape[2]
        if qkv.dtype != k_cache.dtype:  # a pool in another dtype than the model (the tests' float64 pools)
            hq = qkv.shape[1] - 2 * hkv
            q, k = rope(qkv[:, : hq + hkv], cos[positions][:, None], sin[positions][:, None]).split((hq, hkv), 1)
            return self(layer_idx, q, k, qkv[:, hq + hkv :])
        args = (qkv, cos, sin, positions, self.batch.slot_mapping, k_cache, v_cache, self.decode_tables)
        config = (qkv.dtype, qkv.shape[-1], qkv.shape[1], hkv, k_cache.shape[1])
        with counting_runs(self.runs):
            return launch_or_fallback("rope_cache_decode", qkv.device, config,
                                      lambda: rope_cache_decode(*args, self.plan, self.scale),
                                      lambda: rope_cache_decode_ref(*args, self.scale))  # fmt: skip

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_cache, v_cache = self.pool.k_cache[layer_idx], self.pool.v_cache[layer_idx]
        with counting_runs(self.runs):
            reshape_and_cache(
                k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, self.batch.slot_mapping, check=False
            )

    def decode(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_cache[layer_idx], self.pool.v_cache[layer_idx]
        q = q if q.stride(-1) == 1 else q.contiguous()
        plan = self.batch.split_plan if self.all_decode else None  # a plan's lanes are the batch's rows
        splits = "planned" if plan is not None else self.num_splits
        config = (q.dtype, q.shape[-1], q.shape[1] // k_cache.shape[2], k_cache.shape[1], splits)
        if plan is not None:
            launch = lambda: paged_decode_planned(q, k_cache, v_cache, self.decode_tables, plan, self.scale)  # noqa: E731
        else:
            launch = lambda: paged_decode(q, k_cache, v_cache, self.decode_tables, self.decode_lens,  # noqa: E731
                                          self.scale, self.num_splits)  # fmt: skip
        with counting_runs(self.runs):
            return launch_or_fallback(
                "paged_decode_attention", q.device, config, launch, lambda: PagedTorchBackend.decode(self, layer_idx, q)
            )
