"""A decode step's attention in one kernel: RoPE of q and k, the cache write of k and v, paged attention, the merge.

Unfused, a decode layer's attention is four launches: RoPE (:func:`~.triton_fused.rotary_embedding`), the cache
write (:func:`~.triton_cache.reshape_and_cache`), the planned paged kernel and its merge
(:func:`~.triton_paged.paged_decode_planned`). At 3-5 microseconds a launch, and 30 layers, that is most of what a
small model's decode step costs on a GPU. Here one program per (work item of the plan, KV head) does it all:

1. loads its query heads from the packed QKV projection and rotates them (the cos/sin rows read at the token's
   position from the model's tables: no gather of the rows before the layers);
2. if its chunk holds the new token, rotates that token's key, writes key and value to their slot, and waits for
   the whole program's stores (a barrier) before it reads them back with the rest of the chunk;
3. attends over its chunk as :func:`~.triton_paged.paged_decode_planned` does (the same tiles, the same dots, so
   fp32 results equal the unfused path's, bit for bit);
4. a sequence in several chunks: each chunk writes its partial output and log-sum-exp, then takes a ticket from a
   counter per (sequence, KV head); the chunk that arrives last merges them all (the "last block reduces" of
   split-K kernels) and sets the counter back to 0, so one zeroed buffer serves every layer and every step.

Only steps whose sequences all decode one token take this path (the backend's ``all_decode``, a CUDA graph's decode
steps); a step with prefill rows keeps the unfused launches. :func:`rope_cache_decode_ref` is the torch reference.
"""

from __future__ import annotations

import torch

from .fused_torch import rope_torch
from .reference import paged_attention, reshape_and_cache_ref
from .split_plan import SplitPlan
from .triton_decode import LOG2E, group_rows, tile_config
from .triton_fused import _rounded
from .triton_runtime import compute_capability, dot_precision, interpreting, tl, triton, upcast

__all__ = ["rope_cache_decode", "rope_cache_decode_ref"]


@triton.jit
def _rotated(Row, Cos, Sin, d, d_ok, mask, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """Rows at ``Row`` rotated as :func:`~.triton_fused.rotary_embedding` rotates them, in ``DTYPE`` (rounded alike)."""
    x = tl.load(Row + d, mask=mask, other=0.0).to(tl.float32)
    x_swapped = tl.load(Row + (d + HEAD_DIM // 2) % HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(Cos + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(Sin + d, mask=d_ok, other=0.0).to(tl.float32)
    x_cos = _rounded(x * cos, DTYPE, BF16_BY_HAND)
    return _rounded(x_cos + x_swapped * sin, DTYPE, BF16_BY_HAND).to(DTYPE)


@triton.jit
def _rope_cache_decode_kernel(
    QKV, Cos, Sin, Positions, Slots, K_cache, V_cache, Block_tables, Work, Seqs, Partial, Lse, Arrivals, Out,
    scale_log2e,
    stride_qn, stride_qh, stride_cos, stride_sin,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_pw, stride_ph, stride_lw, stride_lh, stride_ob, stride_oh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):  # fmt: skip
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(Work + 4 * work)  # work row (b, start, end, chunks of b): see split_plan.py
    if b < 0:
        return
    start = tl.load(Work + 4 * work + 1)
    end = tl.load(Work + 4 * work + 2)
    chunks = tl.load(Work + 4 * work + 3)
    dtype = Out.dtype.element_ty

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok, d_ok = h < GROUP, d < HEAD_DIM
    heads = kv_head * GROUP + h
    position = tl.load(Positions + b)
    cos, sin = Cos + position * stride_cos, Sin + position * stride_sin
    row = QKV + b * stride_qn
    q_mask = h_ok[:, None] & d_ok[None, :]
    q = _rotated(row + heads[:, None] * stride_qh, cos, sin, d[None, :], d_ok[None, :], q_mask,
                 HEAD_DIM, dtype, BF16_BY_HAND)  # fmt: skip
    if end == position + 1:  # this chunk ends at the new token: rotate its key, write key and value to the pool
        slot = tl.load(Slots + b)
        if slot >= 0:
            k_new = _rotated(row + (NUM_Q_HEADS + kv_head) * stride_qh, cos, sin, d, d_ok, d_ok,
                             HEAD_DIM, dtype, BF16_BY_HAND)  # fmt: skip
            v_new = tl.load(row + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * stride_qh + d, mask=d_ok)
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            tl.store(K_cache + block * stride_kb + offset * stride_kt + kv_head * stride_kh + d,
                     k_new.to(K_cache.dtype.element_ty), mask=d_ok)  # fmt: skip
            tl.store(V_cache + block * stride_vb + offset * stride_vt + kv_head * stride_vh + d,
                     v_new.to(V_cache.dtype.element_ty), mask=d_ok)  # fmt: skip
        tl.debug_barrier()  # every thread's stores done before any thread loads the tile that holds them
    if UPCAST:
        q = q.to(tl.float32)

    # The chunk's positions, exactly as _paged_decode_kernel walks them.
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
    table = Block_tables + b * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K_cache + (block * stride_kb + offset * stride_kt + kv_head * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        v = tl.load(V_cache + (block * stride_vb + offset * stride_vt + kv_head * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / l[:, None]
    o_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if chunks == 1:
        tl.store(o_ptrs, out.to(dtype), mask=q_mask)
    else:
        tl.store(Partial + work * stride_pw + heads[:, None] * stride_ph + d[None, :], out, mask=q_mask)
        tl.store(Lse + work * stride_lw + heads * stride_lh, m + tl.log2(l), mask=h_ok)
        tl.debug_barrier()  # the partial is written (by every thread) before the ticket says so
        ticket = tl.atomic_add(Arrivals + b * NUM_KV_HEADS + kv_head, 1, sem="acq_rel")
        if ticket == chunks - 1:  # the last chunk of (b, kv_head): merge every chunk's result, online
            first = tl.load(Seqs + 4 * b)
            m = tl.full([BLOCK_H], float("-inf"), tl.float32)
            total = tl.full([BLOCK_H], 0.0, tl.float32)
            acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
            for w in range(first, first + chunks):
                lse = tl.load(Lse + w * stride_lw + heads * stride_lh, mask=h_ok, other=0.0, cache_modifier=".cg")
                o = tl.load(Partial + w * stride_pw + heads[:, None] * stride_ph + d[None, :], mask=q_mask,
                            other=0.0, cache_modifier=".cg")  # fmt: skip
                m_new = tl.maximum(m, lse)
                alpha = tl.exp2(m - m_new)
                weight = tl.exp2(lse - m_new)
                acc = acc * alpha[:, None] + weight[:, None] * o
                total = total * alpha + weight
                m = m_new
            tl.store(o_ptrs, (acc / total[:, None]).to(dtype), mask=q_mask)
            tl.atomic_xchg(Arrivals + b * NUM_KV_HEADS + kv_head, 0)  # ready for the next layer


_ARRIVALS: dict[torch.device, torch.Tensor] = {}  # device -> int32 counters, zero between launches


def arrival_counters(lanes: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The zeroed ``[lanes * Hkv]`` counters of the merge, kept per device: made once (the largest graph is recorded
    first), outside any recording, and left at zero by every launch."""
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < lanes * num_kv_heads:
        counters = _ARRIVALS[device] = torch.zeros(lanes * num_kv_heads, dtype=torch.int32, device=device)
    return counters


def rope_cache_decode(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    plan: SplitPlan,
    scale: float,
    capability: int | None = None,
) -> torch.Tensor:
    """One decode step's attention for one layer, in one launch, on inputs already checked (see the module doc).

    ``qkv [B, Hq + 2 Hkv, D]``: the packed projection of the step's B one-token sequences, not rotated;
    ``cos, signed_sin [L, D]``: the model's tables (:func:`~.fused.rope_tables_signed`), indexed by ``positions [B]``;
    ``slot_mapping [B]``: where each new key and value go (-1: nowhere). The pool and tables as for
    :func:`~.triton_paged.paged_decode_planned`, ``plan`` filled from the step's lengths (each ``positions[b] + 1``).
    Returns the attention output ``[B, Hq, D]`` in ``qkv``'s dtype, and the pool holds the new keys and values.
    """
    batch, heads, head_dim = qkv.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    hq = heads - 2 * hkv
    if capability is None:
        capability = compute_capability(qkv.device)
    cfg = tile_config(head_dim, qkv.dtype, capability)
    out = torch.empty(batch, hq, head_dim, dtype=qkv.dtype, device=qkv.device)
    partial = torch.empty(plan.capacity, hq, head_dim, dtype=torch.float32, device=qkv.device)
    lse = torch.empty(plan.capacity, hq, dtype=torch.float32, device=qkv.device)
    arrivals = arrival_counters(plan.lanes, hkv, qkv.device)
    _rope_cache_decode_kernel[(plan.capacity, hkv)](
        qkv, cos, signed_sin, positions, slot_mapping, k_cache, v_cache, block_tables, plan.work, plan.seqs,
        partial, lse, arrivals, out, scale * LOG2E,
        qkv.stride(0), qkv.stride(1), cos.stride(0), signed_sin.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0), *partial.stride()[:2], *lse.stride(),
        out.stride(0), out.stride(1),
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, GROUP=hq // hkv, BLOCK_H=group_rows(hq // hkv), HEAD_DIM=head_dim,
        BLOCK_D=cfg["BLOCK_D"], BLOCK_SIZE=block_size, BLOCK_N=cfg["BLOCK_N"], UPCAST=upcast(qkv.dtype),
        DOT_PRECISION=dot_precision(qkv.dtype), BF16_BY_HAND=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def rope_cache_decode_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`rope_cache_decode` in torch, the unfused way: RoPE, the cache write, then paged attention."""
    hkv = k_cache.shape[2]
    hq = qkv.shape[1] - 2 * hkv
    rows = positions.to(torch.int64)
    qk = rope_torch(qkv[:, : hq + hkv], cos[rows][:, None], signed_sin[rows][:, None])
    reshape_and_cache_ref(qk[:, hq:], qkv[:, hq + hkv :], k_cache, v_cache, slot_mapping, check=False)
    lens = rows + 1
    return paged_attention(qk[:, None, :hq], rows[:, None], k_cache, v_cache, block_tables, lens, scale,
                           int(lens.max()))[:, 0]  # fmt: skip
