"""Paged decode attention in Triton, with split-KV (flash-decoding) and int8 or fp8 K/V.

The contiguous kernel (:mod:`.triton_decode`) changes in one place: where position ``n`` of sequence
``b`` lives. In a paged pool ``[num_blocks, block_size, Hkv, D]`` it is offset ``n % block_size`` of
block ``block_tables[b, n // block_size]`` -- the slot mapping of chapter 4, computed inside the kernel
for a whole tile of positions at once. Nothing else moves: the same grouping of query heads, the same
online softmax, the same masks.

**Split-KV.** One program per (sequence, KV head) gives a batch-1 decode of an 8-KV-head model eight
programs: eight of a GPU's 100+ streaming multiprocessors work, the rest wait, and the step takes as
long as one program needs to read the whole context. Flash-decoding (Dao et al., 2023) cuts each
sequence's context into ``num_splits`` ranges, one program each (stage 1). Each program writes its
partial output, normalised over its own range, and the log-sum-exp ``lse`` of its scores. Stage 2
merges them: with ``M = max_i lse_i``, ``out = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M)``. A
range past the end of a short sequence is empty: it writes ``lse = -inf`` and weighs nothing.

**Planned splits** (:func:`paged_decode_planned`). Under a CUDA graph the grid above is frozen at recording, with
the split count of the lengths the recording saw. The planned launch reads its work instead: program ``i`` takes
work row ``i`` of a plan made on the host from the step's real lengths (:mod:`.split_plan`: a sequence, a range of
its positions), the grid is the plan's capacity, and rows past the plan exit at once. A sequence in one chunk writes
its output directly; the chunks of a split one are merged by :func:`_merge_planned_kernel`, any number of them.

**int8 K/V.** With ``k_scale, v_scale [num_blocks, block_size, Hkv]`` (one fp32 scale per token and
head, :mod:`.int8`) the kernel loads int8 values, converts them exactly to the query's dtype, and
applies the scales where they cost least: ``q . (s_k k) = s_k (q . k)`` scales a score, and
``sum_n p_n (s_v,n v_n) = sum_n (p_n s_v,n) v_n`` scales a probability. Half the bytes of fp16 are read,
but half the bytes did not mean half the time: on an NVIDIA H200 this int8 path was slower than fp16 at every
shape of 32 or more sequences and 64k or more tokens (:mod:`kvcourse.bench.measured`; chapter 5 gives the hypotheses for why).
"""

from __future__ import annotations

import functools

import torch

from .fp8 import paged_decode_attention_fp8_ref
from .int8 import check_paged_int8, paged_decode_attention_int8_ref
from .reference import _default_scale, check_block_tables, check_paged, paged_decode_attention_ref
from .split_plan import SplitPlan
from .triton_decode import LOG2E, group_rows, tile_config
from .triton_runtime import (
    check_kernel_device,
    compute_capability,
    dot_precision,
    launch_or_fallback,
    tl,
    triton,
    upcast,
)

__all__ = [
    "INT8_CONVERSIONS",
    "MAX_SPLITS",
    "MIN_SPLIT_TOKENS",
    "PROGRAMS_PER_SM",
    "SPLIT_FROM_TOKENS",
    "choose_num_splits",
    "decode_workspace",
    "int8_tile_to_float",
    "int8_to_float",
    "paged_decode",
    "paged_decode_attention",
    "paged_decode_attention_fp8",
    "paged_decode_attention_int8",
    "paged_decode_planned",
    "planned_workspace",
]

MAX_SPLITS = 64  # stage 2 merges up to this many partial results per head in one tile
MIN_SPLIT_TOKENS = 256  # no split shorter than this: fewer, longer splits merge cheaper
SPLIT_FROM_TOKENS = 4096  # a shorter longest context is read unsplit (see choose_num_splits)
PROGRAMS_PER_SM = 32  # stage 1's programs aimed at, at most, per streaming multiprocessor


def choose_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int | None) -> int:
    """How many KV splits a decode step should use, fitted to every count timed on an H200 (``bench splits``).

    Stage 1 runs ``batch_size * num_kv_heads * num_splits`` programs. The count is the largest power of two that
    keeps them to :data:`PROGRAMS_PER_SM` per streaming multiprocessor (``num_sms``) and every split of the longest
    context :data:`MIN_SPLIT_TOKENS` positions or more, at most :data:`MAX_SPLITS`; a longest context under
    :data:`SPLIT_FROM_TOKENS` is not split. Why, from ``kvcourse/results/splits-nvidia-h200-2026-11-28.json``: at
    2,048 tokens or fewer most counts ran slower than one split (26 of the 34 timed; a split also launches the
    merge), and one split was within 10% of the fastest at 4 of those 6 shapes; from 8k tokens on, the fastest
    counts ran 2 to 31 times the first heuristic's two programs per SM (except 1 x 8k: fastest at 8 splits, 16 to
    64 within 10%). Powers of two, because the counts in between timed were not faster.
    The inputs are host ints, so an engine decides without reading the device. ``num_sms=None`` (the CPU
    interpreter, where programs run one after another) gives 1.
    """
    for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads), ("max_seq_len", max_seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_sms is None or max_seq_len < SPLIT_FROM_TOKENS:
        return 1
    most = min(PROGRAMS_PER_SM * num_sms // (batch_size * num_kv_heads), max_seq_len // MIN_SPLIT_TOKENS, MAX_SPLITS)
    return 1 << (max(most, 1).bit_length() - 1)  # the largest power of two <= most


@functools.cache
def num_sms(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device; ``None`` elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


INT8_CONVERSIONS = ("bits", "cvt")  # how the kernel turns int8 into the query's dtype; "bits" is the default


@triton.jit
def int8_to_float(x, dtype: tl.constexpr):
    """int8 -> ``dtype``, exactly, with integer and float adds instead of the conversion unit.

    The byte, moved to 0..255 by flipping its sign bit, becomes the low mantissa bits of 2**10 (fp16) or 2**23 (fp32):
    the float with those bits is 2**10 + x + 128, and subtracting 2**10 + 128 leaves x (integers below 2**11, so
    nothing rounds). Compiled for sm_90, the plain ``x.to(tl.float16)`` became 48 ``I2F.F16.S16`` in the paged
    kernel, a conversion-unit instruction that issues at a quarter of an fp32 add's rate or less; this way has none
    (``python -m kvcourse.bench.instructions``).
    """
    if dtype == tl.float16:  # two values per 32-bit register
        biased16 = (x.to(tl.uint8, bitcast=True).to(tl.int16) ^ 0x80) | 0x6400
        return biased16.to(tl.float16, bitcast=True) - 1152.0
    biased = (x.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80) | 0x4B000000
    return (biased.to(tl.float32, bitcast=True) - 8388736.0).to(dtype)


@triton.jit
def int8_tile_to_float(x, dtype: tl.constexpr):
    """:func:`int8_to_float` on a ``[rows, cols]`` tile, done in the registers that loaded it (``cols`` even).

    Converted as one elementwise chain, the compiler moved the conversion after the tile's change to the tensor
    cores' operand layout, so the int8 tile crossed shared memory as single bytes (16 ``LDS.U8`` a loop on sm_80).
    Splitting the tile into its even and odd columns and joining them back, operations the compiler cannot move an
    operand layout through, keeps the conversion where the load leaves the values: 128-bit shared loads after the
    asynchronous copy, the 16-bit tile to the tensor cores by ``ldmatrix`` (``python -m kvcourse.bench.instructions``).
    """
    rows: tl.constexpr = x.shape[0]
    cols: tl.constexpr = x.shape[1]
    even, odd = tl.split(tl.reshape(x, [rows, cols // 2, 2]))
    return tl.reshape(tl.join(int8_to_float(even, dtype), int8_to_float(odd, dtype)), [rows, cols])


@triton.jit
def _paged_decode_kernel(
    Q, K_cache, V_cache, K_scale, V_scale, Block_tables, Seq_lens, Out, Lse,
    Work, Final,  # PLANNED: the plan's work rows [capacity, 4], and the output [B, Hq, D] (Out, Lse: partials)
    scale_log2e,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,  # K pool: block, token slot in the block, head (D has stride 1)
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st, stride_sh,  # int8 scales [num_blocks, block_size, Hkv]
    stride_bt,
    stride_ob, stride_oh, stride_os,  # Out: [B, Hq, D] when NUM_SPLITS == 1, else fp32 [B, Hq, NUM_SPLITS, D]
    stride_lb, stride_lh,  # Lse: fp32 [B, Hq, NUM_SPLITS]
    stride_fb, stride_fh,  # Final (PLANNED)
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # positions per tile (any multiple or fraction of BLOCK_SIZE)
    NUM_SPLITS: tl.constexpr,
    KV_INT8: tl.constexpr,
    KV_FP8: tl.constexpr,  # e4m3 values with int8's scales (sm_89 and later convert them natively)
    INT8_BITS: tl.constexpr,  # int8 -> float by int8_to_float (True) or by a plain conversion (the first version)
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PLANNED: tl.constexpr,  # program 0's index is a work row of a plan (split_plan.py), not a sequence
):  # fmt: skip
    kv_head = tl.program_id(1)
    if PLANNED:
        # Work row (b, start, end, chunks of b), planned on the host from the step's real lengths. The grid is the
        # plan's capacity, fixed when a graph was recorded: rows past this step's plan say b = -1.
        work = tl.program_id(0)
        b = tl.load(Work + 4 * work)
        if b < 0:
            return
        start = tl.load(Work + 4 * work + 1)
        end = tl.load(Work + 4 * work + 2)
        chunks = tl.load(Work + 4 * work + 3)
    else:
        b = tl.program_id(0)
        split = tl.program_id(2)
        seq_len = tl.load(Seq_lens + b)
        split_len = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)  # this program's positions: start .. end - 1 (maybe none)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok, d_ok = h < GROUP, d < HEAD_DIM
    heads = kv_head * GROUP + h
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
    table = Block_tables + b * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        n_ok = n < end
        # The block-table indirection: logical block n // BLOCK_SIZE -> physical block, offset n % BLOCK_SIZE.
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_ptrs = K_cache + (block * stride_kb + offset * stride_kt + kv_head * stride_kh)[:, None] + d[None, :]
        v_ptrs = V_cache + (block * stride_vb + offset * stride_vt + kv_head * stride_vh)[:, None] + d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if KV_INT8:  # int8 -> the query's dtype is exact (|x| <= 127); the scales come after the dots
            if INT8_BITS:
                k, v = int8_tile_to_float(k, q.dtype), int8_tile_to_float(v, q.dtype)
            else:
                k, v = k.to(q.dtype), v.to(q.dtype)
        elif KV_FP8:  # e4m3 -> the query's dtype: exact (fp16 holds every e4m3 value), one conversion in hardware
            k, v = k.to(q.dtype), v.to(q.dtype)
        elif UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        if KV_INT8 or KV_FP8:
            scale_off = block * stride_sb + offset * stride_st + kv_head * stride_sh
            s = s * tl.load(K_scale + scale_off, mask=n_ok, other=0.0)[None, :]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if KV_INT8 or KV_FP8:
            p = p * tl.load(V_scale + scale_off, mask=n_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    o_mask = h_ok[:, None] & d_ok[None, :]
    if PLANNED:
        # A sequence in one chunk is done: straight to the output. A chunk of a split sequence writes its partial
        # output and log-sum-exp at its work row, for _merge_planned_kernel. (The planner makes no empty chunk.)
        out = acc / l[:, None]
        if chunks == 1:
            f_ptrs = Final + b * stride_fb + heads[:, None] * stride_fh + d[None, :]
            tl.store(f_ptrs, out.to(Final.dtype.element_ty), mask=o_mask)
        else:
            tl.store(Out + work * stride_ob + heads[:, None] * stride_oh + d[None, :], out, mask=o_mask)
            tl.store(Lse + work * stride_lb + heads * stride_lh, m + tl.log2(l), mask=h_ok)
    elif NUM_SPLITS == 1:
        out = acc / l[:, None]
        tl.store(
            Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty), mask=o_mask
        )
    else:
        # An empty split (start >= end) summed nothing: l = 0. It writes o = 0 and lse = -inf.
        nonempty = l > 0
        out = acc / tl.where(nonempty, l, 1.0)[:, None]
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))  # log2 units
        o_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(o_ptrs, out, mask=o_mask)
        tl.store(Lse + b * stride_lb + heads * stride_lh + split, lse, mask=h_ok)


@triton.jit
def _merge_splits_kernel(
    Partial, Lse, Out,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Stage 2: one program per (sequence, query head) merges its splits' partial outputs."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok, d_ok = s < NUM_SPLITS, d < HEAD_DIM
    lse = tl.load(Lse + b * stride_lb + head * stride_lh + s, mask=s_ok, other=float("-inf"))
    o = tl.load(
        Partial + b * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    w = tl.exp2(lse - tl.max(lse, 0))  # empty splits: exp2(-inf) = 0; at least one split is not empty
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    capability: int | None = None,
    int8_conversion: str = "bits",
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Launch the kernels on inputs already checked: no validation, no host-device synchronisation.

    The attention backend calls this once per layer; :func:`paged_decode_attention` checks, then calls it.
    ``capability`` picks the launch parameters (:func:`~.triton_decode.tile_config`); default: the device's.
    ``int8_conversion``: ``"bits"`` (:func:`int8_to_float`) or ``"cvt"`` (the first version's plain conversion, kept
    so that a benchmark can time the two on a GPU; see :data:`INT8_CONVERSIONS`).

    ``out`` (``[B, Hq, D]``, the query's dtype) and ``workspace`` (fp32 ``partial [>= B, Hq, >= num_splits, D]`` and
    ``lse [>= B, Hq, >= num_splits]``, the split path's scratch) let a caller that keeps them, as an engine can,
    launch without allocating: at small shapes each ``torch.empty`` is a measurable part of a call. Made here when
    not given (:func:`decode_workspace` makes a pair to keep).
    """
    if int8_conversion not in INT8_CONVERSIONS:  # the one check: a typo would silently time the other variant
        raise ValueError(f"int8_conversion must be one of {INT8_CONVERSIONS}, got {int8_conversion!r}")
    batch, hq, head_dim = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    quantized = k_scale is not None  # int8 or fp8 values with per-token scales
    fp8 = quantized and k_cache.dtype == torch.float8_e4m3fn
    if capability is None:
        capability = compute_capability(q.device)
    cfg = tile_config(head_dim, q.dtype, capability, k_cache.dtype)
    scales = (k_scale, v_scale) if quantized else (q, q)  # unused pointers for a float pool
    s_strides = k_scale.stride() if quantized else (0, 0, 0)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_splits == 1:
        partial, lse = out, out  # stage 1 writes the final output directly
        o_strides, l_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        if workspace is None:
            workspace = decode_workspace(batch, hq, head_dim, num_splits, q.device)
        partial, lse = workspace[0][:batch, :, :num_splits], workspace[1][:batch, :, :num_splits]
        o_strides, l_strides = partial.stride()[:3], lse.stride()[:2]
    _paged_decode_kernel[(batch, hkv, num_splits)](
        q, k_cache, v_cache, *scales, block_tables, seq_lens, partial, lse, seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *s_strides,
        block_tables.stride(0), *o_strides, *l_strides, 0, 0,
        GROUP=group, BLOCK_H=group_rows(group), HEAD_DIM=head_dim, BLOCK_D=cfg["BLOCK_D"], BLOCK_SIZE=block_size,
        BLOCK_N=cfg["BLOCK_N"], NUM_SPLITS=num_splits, KV_INT8=quantized and not fp8, KV_FP8=fp8,
        INT8_BITS=int8_conversion == "bits", UPCAST=upcast(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype), PLANNED=False, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(batch, hq)](
            partial, lse, out, *partial.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            BLOCK_D=cfg["BLOCK_D"], num_warps=4,
        )  # fmt: skip
    return out


@triton.jit
def _merge_planned_kernel(
    Partial, Lse, Out, Seqs,
    stride_pw, stride_ph,
    stride_lw, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # chunks merged per iteration
):  # fmt: skip
    """Stage 2 of a planned step: one program per (lane, query head) merges the chunks of a split sequence.

    Its chunks are work rows ``first .. first + count - 1`` (``Seqs[b]``). A lane in one chunk (written by stage 1)
    or none (padding) has nothing to merge. The merge is online, ``BLOCK_S`` chunks at a time, so a long sequence
    may have any number of chunks: ``M`` the running maximum of the log-sum-exps, every partial weighted by
    ``exp2(lse - M)``, rescaled when ``M`` grows (the online softmax of the chunks' results).
    """
    b = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(Seqs + 4 * b)
    count = tl.load(Seqs + 4 * b + 1)
    if count < 2:
        return
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.full([1], 0.0, tl.float32)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    for s0 in range(first, first + count, BLOCK_S):
        rows = s0 + s
        s_ok = rows < first + count
        lse = tl.load(Lse + rows * stride_lw + head * stride_lh, mask=s_ok, other=float("-inf"))
        o = tl.load(
            Partial + rows[:, None] * stride_pw + head * stride_ph + d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, 0))  # finite: every row of this tile up to count is a non-empty chunk
        alpha = tl.exp2(m - m_new)  # the first tile: exp2(-inf) = 0, and acc, total are 0 anyway
        w = tl.exp2(lse - m_new)  # rows past count: exp2(-inf) = 0
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        total = total * alpha + tl.sum(w, 0)
        m = m_new
    tl.store(Out + b * stride_ob + head * stride_oh + d, (acc / total).to(Out.dtype.element_ty), mask=d_ok)


PLANNED_MERGE_TILE = 16  # chunks _merge_planned_kernel reads per iteration


def paged_decode_planned(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    plan: SplitPlan,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    capability: int | None = None,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """:func:`paged_decode` with the split-KV work read from a plan (:mod:`.split_plan`), on inputs already checked.

    The grid is ``(plan.capacity, Hkv)`` for stage 1 and ``(B, Hq)`` for the merge: neither depends on the step's
    lengths, so a CUDA graph recorded once replays every step with that step's own plan (refill ``plan`` before the
    replay, :meth:`~.split_plan.SplitPlan.fill`). The lengths themselves come from the plan's work rows; the block
    tables still say where each position lives. ``workspace``: fp32 ``partial [>= capacity, Hq, D]`` and
    ``lse [>= capacity, Hq]`` (:func:`planned_workspace`), made here when not given; ``out`` as in
    :func:`paged_decode` (rows of lanes without tokens are left as they were). ``tiles``: ``(BLOCK_N, num_warps,
    num_stages)`` instead of :func:`~.triton_decode.tile_config`'s, for a benchmark to time the alternatives.
    """
    # Host-only checks (no read-back): what the plan's shape must agree with.
    if not isinstance(plan, SplitPlan):
        raise TypeError(f"plan must be a kvcourse.kernels.split_plan.SplitPlan, got {type(plan).__name__}")
    batch, hq, head_dim = q.shape
    if batch > plan.lanes:
        raise ValueError(f"plan holds {plan.lanes} lanes but q has batch size {batch}")
    if plan.buffer.device != q.device:
        raise ValueError(f"plan is on {plan.buffer.device} but q is on {q.device}: make the SplitPlan on q's device")
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    quantized = k_scale is not None
    fp8 = quantized and k_cache.dtype == torch.float8_e4m3fn
    if capability is None:
        capability = compute_capability(q.device)
    cfg = dict(tile_config(head_dim, q.dtype, capability, k_cache.dtype))
    if quantized and capability is not None:
        # The plan's loads and the two-way store keep a few more registers live: on sm_80 the int8 pool with bf16
        # queries at D = 64 in 64-wide tiles spilled 8 bytes (64 registers, 8 warps); 32-wide tiles spill nothing
        # (tests/test_kernels_native_planned.py compiles every named shape).
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 32)
    if tiles is not None:
        ints = len(tiles) == 3 and all(not isinstance(t, bool) and isinstance(t, int) and t >= 1 for t in tiles)
        if not ints or any(t & (t - 1) for t in tiles[:2]):
            raise ValueError(
                f"tiles must be (BLOCK_N, num_warps, num_stages), positive ints, the first two powers of "
                f"two, got {tiles!r}"
            )
        cfg.update(BLOCK_N=max(16, tiles[0]), num_warps=tiles[1], num_stages=tiles[2])  # tl.dot needs 16 or more
    scales = (k_scale, v_scale) if quantized else (q, q)
    s_strides = k_scale.stride() if quantized else (0, 0, 0)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if workspace is None:
        workspace = planned_workspace(plan.capacity, hq, head_dim, q.device)
    partial, lse = workspace
    _paged_decode_kernel[(plan.capacity, hkv)](
        q, k_cache, v_cache, *scales, block_tables, block_tables, partial, lse, plan.work, out, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *s_strides,
        block_tables.stride(0), partial.stride(0), partial.stride(1), 0, lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, BLOCK_H=group_rows(hq // hkv), HEAD_DIM=head_dim, BLOCK_D=cfg["BLOCK_D"],
        BLOCK_SIZE=block_size, BLOCK_N=cfg["BLOCK_N"], NUM_SPLITS=1, KV_INT8=quantized and not fp8, KV_FP8=fp8,
        INT8_BITS=True, UPCAST=upcast(q.dtype), DOT_PRECISION=dot_precision(q.dtype), PLANNED=True,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    _merge_planned_kernel[(batch, hq)](
        partial, lse, out, plan.seqs, partial.stride(0), partial.stride(1), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=cfg["BLOCK_D"], BLOCK_S=PLANNED_MERGE_TILE,
        num_warps=4,
    )  # fmt: skip
    return out


def planned_workspace(capacity: int, num_q_heads: int, head_dim: int, device: torch.device | str,
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A planned step's scratch: fp32 partial outputs ``[capacity, Hq, D]`` and log-sum-exps ``[capacity, Hq]``,
    one row per work item, to keep and hand to :func:`paged_decode_planned`."""
    partial = torch.empty(capacity, num_q_heads, head_dim, dtype=torch.float32, device=device)
    return partial, torch.empty(capacity, num_q_heads, dtype=torch.float32, device=device)


def decode_workspace(batch: int, num_q_heads: int, head_dim: int, num_splits: int, device: torch.device | str,
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The split path's scratch for up to ``batch`` sequences and ``num_splits`` splits: fp32 partial outputs and
    their log-sum-exps, to keep and hand to :func:`paged_decode` as ``workspace``."""
    partial = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    return partial, torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device)


def check_num_splits(num_splits: int | None, batch: int, hkv: int, max_seq_len: int, device: torch.device) -> int:
    """``num_splits`` as given (validated), or chosen by :func:`choose_num_splits` when ``None``."""
    if num_splits is None:
        return choose_num_splits(batch, hkv, max_seq_len, num_sms(device))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}] or None (chosen for you), got {num_splits!r}")
    return num_splits


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention read through block tables: ``q [B, Hq, D]`` -> ``[B, Hq, D]``.

    Args:
        q: one query per sequence (its newest token).
        k_cache, v_cache: one layer's pool, ``[num_blocks, block_size, Hkv, D]``, the dtype of ``q``.
        block_tables: int32 ``[B, max_blocks]``; row ``b``'s first ``ceil(seq_lens[b] / block_size)``
            entries are sequence ``b``'s blocks, the rest padding (never read).
        seq_lens: int32 ``[B]``, cached tokens per sequence.
        scale: softmax scale, default ``1 / sqrt(D)``.
        num_splits: KV splits per sequence (flash-decoding); ``None`` picks :func:`choose_num_splits`.

    Equal to :func:`~kvcourse.kernels.reference.paged_decode_attention_ref`.
    """
    check_paged(q, k_cache, v_cache, "[B, Hq, D]")
    lens = check_block_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1], q.device)
    if len(lens) != q.shape[0]:
        raise ValueError(f"block_tables and seq_lens have {len(lens)} rows but q has batch size {q.shape[0]}")
    return _checked_launch("paged_decode_attention", paged_decode_attention_ref, q, k_cache, v_cache, (),
                           block_tables, seq_lens, lens, scale, num_splits)  # fmt: skip


def paged_decode_attention_int8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """:func:`paged_decode_attention` on an int8 pool, dequantized inside the kernel.

    ``k_cache, v_cache`` int8 ``[num_blocks, block_size, Hkv, D]``, ``k_scale, v_scale`` fp32
    ``[num_blocks, block_size, Hkv]`` (written by :func:`~kvcourse.kernels.triton_cache.reshape_and_cache_int8`).
    Equal to :func:`~kvcourse.kernels.int8.paged_decode_attention_int8_ref`.
    """
    return _quantized_decode("paged_decode_attention_int8", paged_decode_attention_int8_ref, torch.int8,
                             q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale, num_splits)  # fmt: skip


def paged_decode_attention_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """:func:`paged_decode_attention` on an fp8 (e4m3) pool: int8's layout and scales, ``torch.float8_e4m3fn``
    values (:func:`~kvcourse.kernels.fp8.quantize_fp8`), converted in the kernel. GPUs convert e4m3 natively from
    compute capability 8.9 on; where Triton cannot compile it (a T4, an A100) the torch reference answers, counted
    as a fallback. Equal to :func:`~kvcourse.kernels.fp8.paged_decode_attention_fp8_ref`."""
    return _quantized_decode("paged_decode_attention_fp8", paged_decode_attention_fp8_ref, torch.float8_e4m3fn,
                             q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale, num_splits)  # fmt: skip


def _quantized_decode(
    name, reference, dtype, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale, num_splits
) -> torch.Tensor:
    """The int8 and fp8 wrappers: their pool's checks, then :func:`_checked_launch`."""
    lens = check_paged_int8(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, dtype)
    if k_scale.stride() != v_scale.stride():
        raise ValueError(
            f"k_scale and v_scale must have one layout, got strides {k_scale.stride()} and {v_scale.stride()}"
        )
    return _checked_launch(name, reference, q, k_cache, v_cache, (k_scale, v_scale), block_tables, seq_lens, lens,
                           scale, num_splits)  # fmt: skip


def _checked_launch(
    name, reference, q, k_cache, v_cache, scales, block_tables, seq_lens, lens, scale, num_splits
) -> torch.Tensor:
    """What every paged wrapper checks after its pool's own checks, then the launch, or ``reference`` (called as
    ``reference(q, k_cache, v_cache, *scales, block_tables, seq_lens, scale)``) where the kernel cannot compile."""
    check_kernel_device("q", q)
    for what, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{what} must be contiguous in its last dimension (head_dim), got strides {t.stride()}")
    scale = _default_scale(scale, q.shape[-1])
    splits = check_num_splits(num_splits, q.shape[0], k_cache.shape[2], max(lens), q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    config = (q.dtype, q.shape[-1], q.shape[1] // k_cache.shape[2], k_cache.shape[1], splits)
    return launch_or_fallback(
        name,
        q.device,
        config,
        lambda: paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, splits, *scales),
        lambda: reference(q, k_cache, v_cache, *scales, block_tables, seq_lens, scale),
    )
