"""Decode attention on a contiguous cache, in Triton: the kernel chapter 5 builds first.

One new query per sequence, ``q [B, Hq, D]``, against cached ``k, v [B, Hkv, S, D]`` of which sequence
``b`` uses the first ``seq_lens[b]`` positions. Equal to :func:`~kvcourse.kernels.reference.decode_attention_ref`.

The kernel, in three ideas:

* **One program per (sequence, KV head).** With GQA the ``G = Hq / Hkv`` query heads of a group read
  the same K and V, so one program loads each K/V tile once and scores all ``G`` queries against it
  with one ``tl.dot`` (``[G, D] @ [D, BLOCK_N]``). Decode reads every cached byte once per step: that
  read is the whole cost, and grouping divides it by ``G``.
* **A loop over tiles of ``BLOCK_N`` positions with an online softmax.** The running maximum ``m``,
  the running sum ``l`` and the unnormalised output ``acc`` are rescaled by ``exp(m_old - m_new)``
  whenever a tile raises the maximum, so one pass over K/V is enough, whatever the context length.
* **Masks.** Positions ``>= seq_len`` are never loaded (masked loads return 0) and their scores are
  set to ``-inf`` (a zero score would still get weight ``exp(0 - m)``).

``tl.dot`` needs every dimension >= 16 on NVIDIA GPUs, so the group is padded to ``BLOCK_H >= 16`` rows;
the padding rows hold zero queries and are never stored. Softmax uses ``exp2`` with ``log2(e)`` folded
into the scale (one multiply fewer per score, and the GPU's native exponential).
"""

from __future__ import annotations

import torch

from .reference import _default_scale, check_qkv, check_seq_lens, decode_attention_ref
from .triton_runtime import (
    check_kernel_device,
    compute_capability,
    dot_precision,
    launch_or_fallback,
    tl,
    triton,
    upcast,
)

__all__ = ["decode", "decode_attention", "tile_config"]

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
SMEM_BUDGET = 32 * 1024  # bytes of shared memory the K/V tiles of the default launch may use


def tile_config(
    head_dim: int,
    dtype: torch.dtype,
    capability: int | None,
    kv_dtype: torch.dtype | None = None,
) -> dict[str, int]:
    """Launch parameters for the decode kernels: tile width, warps, pipeline stages.

    ``dtype`` is the query's, ``kv_dtype`` the cache's when it differs (int8); ``capability`` the GPU's
    compute capability as one int (75 = sm_75, a T4; 80 = A100; 90 = H100), or ``None`` for Triton's
    interpreter, where every loop iteration costs Python time and tiles are as wide as practical.

    On a GPU a K tile and a V tile of ``BLOCK_N x D`` elements, in the query's dtype (int8 is converted
    before the dots, which see the converted tiles), sit in shared memory per pipeline stage. Two stages
    of both within 32 KiB (half a T4's 64 KiB) gives ``BLOCK_N = 32`` at ``D = 128`` in fp16, 64 at
    ``D = 64``; ``tl.dot`` needs at least 16. Two exceptions, each measured by
    :mod:`~kvcourse.bench.compile_check` (registers per thread from the compiled cubins):

    * **sm_75 (T4)**: Triton lowers these dots to fused multiply-adds, not tensor cores, and an FMA dot
      keeps slices of both operands in registers. 64-wide tiles at 4 warps used all 255 registers and
      spilled (SmolLM2, fp16); 32-wide tiles over 8 warps use 98. A T4 has no ``cp.async`` to
      pipeline loads with, so one stage.
    * **int8 K/V**: converting each tile to the query's dtype keeps both copies live. At 4 warps and
      2 stages, D = 128, that took 128-136 registers with bf16/fp16 queries (8 bytes spilled on
      sm_90) and spilled 136-248 bytes with fp32 queries. 8 warps halve the tile per thread (76-108
      registers); fp32 queries also drop to one stage (about 50-65). fp8 pools spilled 8 bytes with bf16 queries at
      D = 128 for GQA groups of 1 and 8, so on sm_90 and later fp8 with bf16 queries takes 16-wide tiles. (int8
      converted by bits took them too, while its conversion kept the int8 tile live beside the converted one; since
      :func:`~.triton_paged.int8_tile_to_float` converts in the loading registers, 32-wide tiles spill nothing.)
    """
    block_d = head_tile(head_dim)
    if capability is None:  # the interpreter: fewer, wider iterations
        return dict(BLOCK_N=128, BLOCK_D=block_d, num_warps=4, num_stages=1)
    elem = torch.finfo(dtype).bits // 8
    stages, warps = 2, 4
    block_n = max(16, min(64, SMEM_BUDGET // (stages * 2 * block_d * elem)))  # 2 = a K tile and a V tile
    if capability < 80:
        stages, warps, block_n = 1, 8, min(block_n, 32)
    if kv_dtype in (torch.int8, torch.float8_e4m3fn):  # fp8 pools: int8's layout, the same tiles
        warps = 8
        if dtype == torch.float32:
            stages = 1
        elif capability >= 90 and kv_dtype == torch.float8_e4m3fn and dtype == torch.bfloat16:
            block_n = 16
    return dict(BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=stages)  # powers of two, all


def head_tile(head_dim: int) -> int:
    """``BLOCK_D``: ``head_dim`` padded to a power of two and to tl.dot's minimum of 16 (the padded
    columns load as zeros, so they add nothing to a dot; a tiny test model has ``head_dim = 8``)."""
    return max(16, triton.next_power_of_2(head_dim))


def group_rows(group: int) -> int:
    """``BLOCK_H``: the query heads of one KV group, padded to a power of two and to tl.dot's minimum of 16."""
    return max(16, triton.next_power_of_2(group))


@triton.jit
def _decode_kernel(
    Q, K, V, Seq_lens, Out,
    scale_log2e,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # GROUP padded for tl.dot
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_N: tl.constexpr,  # cached positions per tile
    UPCAST: tl.constexpr,  # compute on fp32 copies of the loads (bf16 in the interpreter)
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(Seq_lens + b)

    h = tl.arange(0, BLOCK_H)  # row h of this program is query head kv_head * GROUP + h
    d = tl.arange(0, BLOCK_D)
    h_ok, d_ok = h < GROUP, d < HEAD_DIM
    q_rows = Q + b * stride_qb + (kv_head * GROUP + h)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_rows, mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l = tl.full([BLOCK_H], 0.0, tl.float32)  # running sum of exp2(score - m)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)  # running sum of exp2(score - m) * v
    k_base = K + b.to(tl.int64) * stride_kb + kv_head * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_head * stride_vh
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < seq_len
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + n[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old maximum
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / l[:, None]
    o_rows = Out + b * stride_ob + (kv_head * GROUP + h)[:, None] * stride_oh + d[None, :]
    tl.store(o_rows, out.to(Out.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor | list[int] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step on a contiguous cache: ``q [B, Hq, D]``, ``k, v [B, Hkv, S, D]`` -> ``[B, Hq, D]``.

    ``seq_lens[b]`` (default ``S``) cached positions of sequence ``b`` are attended; the rest of its
    ``S`` slots are never read. ``scale`` defaults to ``1 / sqrt(D)``. Same arguments and result as
    :func:`~kvcourse.kernels.reference.decode_attention_ref`.
    """
    hq, hkv = check_qkv(q, k, v, "[B, Hq, D]")
    check_kernel_device("q", q)
    lens = check_seq_lens(seq_lens, q.shape[0], k.shape[2], q.device).to(torch.int32)
    scale = _default_scale(scale, q.shape[-1])
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernel walks D with stride 1
    group = hq // hkv
    config = (q.dtype, q.shape[-1], group)
    return launch_or_fallback(
        "decode_attention",
        q.device,
        config,
        lambda: decode(q, k, v, lens, scale),
        lambda: decode_attention_ref(q, k, v, lens, scale),
    )


def decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    capability: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Launch the kernel on inputs already checked (``seq_lens`` int32 on ``q``'s device).

    ``capability`` picks the launch parameters (:func:`tile_config`); default: the device's.
    """
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    if capability is None:
        capability = compute_capability(q.device)
    cfg = tile_config(q.shape[-1], q.dtype, capability)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _decode_kernel[(q.shape[0], hkv)](
        q, k, v, seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=group_rows(group), HEAD_DIM=q.shape[-1], BLOCK_D=cfg["BLOCK_D"],
        BLOCK_N=cfg["BLOCK_N"], UPCAST=upcast(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out
