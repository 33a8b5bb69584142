"""Ragged paged attention in Triton: every sequence of a mixed step, prefill chunks and decodes, in one launch.

The decode kernel (:mod:`.triton_paged`) takes one query per sequence. A serving step also holds
prompts, or chunks of prompts, each many queries long, beside the decodes. The ``"triton"`` backend
attends those with torch's SDPA over a padded ``[B, T, S]`` copy: the shapes change every step, so the
step cannot be recorded in a CUDA graph, and on a GPU cuDNN built a new attention plan for every new
shape (about 65 ms each on an H100, more than the rest of the step).

This kernel reads the step as the model packs it, ``q [N, Hq, D]``, with ``query_start_loc`` saying
where each sequence's rows start (vLLM's "unified" attention and FlashAttention's varlen API take the
same). Its grid depends only on ``N`` and the number of sequences, never on their lengths: a CUDA graph
recorded for ``N`` tokens replays any step of at most ``N`` tokens (:mod:`kvcourse.serving.step_graphs`).

* **Programs.** Sequence ``b``'s rows are cut into tiles of ``BLOCK_Q`` queries. Program ``p`` serves
  tile ``p - first[b]`` of the sequence ``b`` whose ``first[b] = query_start_loc[b] // BLOCK_Q + b``
  is the largest at most ``p`` (found by binary search in the kernel). ``N // BLOCK_Q + B`` programs
  cover every tile of every possible split of ``N`` rows; the ones past a sequence's rows stop at once.
* **Rows.** A tile of ``BLOCK_Q`` queries times the ``GROUP`` query heads that share one KV head, so
  each K/V tile loaded serves all of them (as in the decode kernel).
* **Causality.** Query ``i`` of a sequence with ``c`` cached tokens before this step sits at position
  ``c + i`` and sees keys ``0 .. c + i``. A decode is the case of one query.

A sequence with no rows (``query_start_loc[b] == query_start_loc[b + 1]``, a graph's padding lane) gets
no program work; rows past the last sequence's end are never written.
"""

from __future__ import annotations

import itertools

import torch

from .reference import _default_scale, check_paged, paged_prefill_attention_ref
from .triton_decode import LOG2E, tile_config
from .triton_runtime import (check_kernel_device, compute_capability, dot_precision, launch_or_fallback, tl, triton,
                             upcast)  # fmt: skip

__all__ = [
    "BLOCK_ROWS",
    "num_programs",
    "ragged_paged",
    "ragged_paged_attention",
    "ragged_paged_attention_ref",
    "ragged_tile_config",
]

BLOCK_ROWS = 64  # query rows (tokens x heads of a group) per program


def ragged_tile_config(head_dim: int, dtype: torch.dtype, capability: int | None) -> dict[str, int]:
    """Launch parameters: the decode kernels' (:func:`~.triton_decode.tile_config`), with narrower key tiles
    over 8 warps on a GPU.

    A program here holds 64 query rows, four times the decode kernel's 16, so its score tile and its
    accumulator are four times larger. With the decode kernel's tiles (64 keys at ``D = 64``) the fp32
    launches spilled on sm_80/90. :mod:`~kvcourse.bench.compile_check`, run with Triton 3.9 (CI) and
    3.6 (the GPU machines), found these free of spills with both: 16 keys over 8 warps, 32 keys for
    fp16/bf16 on sm_90, and 4 warps for fp32 on sm_80 (8 warps kept an 8-byte stack frame with 3.6).
    """
    cfg = tile_config(head_dim, dtype, capability)
    if capability is not None:
        half = dtype in (torch.float16, torch.bfloat16)
        cfg.update(BLOCK_N=32 if half and capability >= 90 else 16, num_warps=4 if capability == 80 and not half else 8)
    return cfg


def block_q(group: int) -> int:
    """Queries per program: :data:`BLOCK_ROWS` rows of ``group`` heads each (at least one query)."""
    return max(1, BLOCK_ROWS // triton.next_power_of_2(group))


def num_programs(num_tokens: int, num_seqs: int, group: int) -> int:
    """Programs per KV head for ``num_tokens`` rows in ``num_seqs`` sequences, whatever the split."""
    return num_tokens // block_q(group) + num_seqs


@triton.jit
def _ragged_paged_kernel(
    Q, K_cache, V_cache, Block_tables, Seq_lens, Query_start_loc, Out,
    scale_log2e, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two
    BLOCK_Q: tl.constexpr,  # queries per program
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # key positions per tile
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Which sequence: the last b with first[b] = query_start_loc[b] // BLOCK_Q + b <= pid (first[] increases).
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(Query_start_loc + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq_start = tl.load(Query_start_loc + lo)
    seq_end = tl.load(Query_start_loc + lo + 1)
    q_start = seq_start + (pid - (seq_start // BLOCK_Q + lo)) * BLOCK_Q
    if q_start < seq_end:  # else: a tile past this sequence's rows (or a sequence without rows)
        cached = tl.load(Seq_lens + lo) - (seq_end - seq_start)  # tokens before this step's
        r = tl.arange(0, BLOCK_Q * BLOCK_H)
        token = q_start + r // BLOCK_H
        h = r % BLOCK_H
        d = tl.arange(0, BLOCK_D)
        row_ok = (token < seq_end) & (h < GROUP)
        d_ok = d < HEAD_DIM
        head = kv_head * GROUP + h
        q = tl.load(
            Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        q_pos = cached + token - seq_start  # each row's position: it sees keys 0 .. q_pos
        kv_end = tl.minimum(cached + q_start + BLOCK_Q - seq_start, cached + seq_end - seq_start)

        m = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
        l = tl.full([BLOCK_Q * BLOCK_H], 0.0, tl.float32)
        acc = tl.full([BLOCK_Q * BLOCK_H, BLOCK_D], 0.0, tl.float32)
        table = Block_tables + lo * stride_bt
        for tile_start in range(0, kv_end, BLOCK_N):
            n = tile_start + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            offset = n % BLOCK_SIZE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(
                K_cache + (block * stride_kb + offset * stride_kt + kv_head * stride_kh)[:, None] + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                V_cache + (block * stride_vb + offset * stride_vt + kv_head * stride_vh)[:, None] + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
            # Key 0 is visible to every row, so no row is all -inf after the first tile.
            s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        out = acc / l[:, None]
        tl.store(
            Out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def ragged_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    capability: int | None = None,
) -> torch.Tensor:
    """Launch on inputs already checked: no validation, no read back, a grid from the shapes alone.

    ``out``: where to write (rows of no sequence are left as they are); default a new ``empty_like(q)``.
    """
    num_tokens, hq, head_dim = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group, num_seqs = hq // hkv, seq_lens.shape[0]
    if capability is None:
        capability = compute_capability(q.device)
    cfg = ragged_tile_config(head_dim, q.dtype, capability)
    out = torch.empty_like(q) if out is None else out
    grid = (num_programs(num_tokens, num_seqs, group), hkv)
    _ragged_paged_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=triton.next_power_of_2(group), BLOCK_Q=block_q(group), HEAD_DIM=head_dim,
        BLOCK_D=cfg["BLOCK_D"], BLOCK_SIZE=block_size, BLOCK_N=cfg["BLOCK_N"], UPCAST=upcast(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def ragged_paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The same in plain torch: chapter 4's :func:`~.reference.paged_prefill_attention_ref` over the sequences
    that have rows (a graph's spare lanes left out); rows of no sequence come back as zeros."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    keep = [b for b in range(len(lens)) if qsl[b + 1] > qsl[b]]
    out = torch.zeros_like(q)
    if not keep:
        return out
    end = qsl[-1]  # the kept sequences own rows 0 .. end - 1, in order
    positions = torch.cat([torch.arange(lens[b] - (qsl[b + 1] - qsl[b]), lens[b], device=q.device) for b in keep])
    starts = list(itertools.accumulate((qsl[b + 1] - qsl[b] for b in keep), initial=0))
    rows = torch.tensor(keep, device=q.device)
    out[:end] = paged_prefill_attention_ref(
        q[:end], k_cache, v_cache, block_tables[rows], seq_lens[rows],
        torch.tensor(starts, dtype=torch.int32, device=q.device), positions, scale,
    )  # fmt: skip
    return out


def ragged_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a packed step through block tables: ``q [N, Hq, D]`` -> ``[N, Hq, D]``.

    Args:
        q: the step's queries, sequence after sequence (sequence ``b`` owns rows
            ``query_start_loc[b] .. query_start_loc[b + 1] - 1``).
        k_cache, v_cache: one layer's pool ``[num_blocks, block_size, Hkv, D]``, this step's K/V already written.
        block_tables: int32 ``[B, max_blocks]``.
        seq_lens: int32 ``[B]``: tokens of each sequence after this step (cached + new).
        query_start_loc: int32 ``[B + 1]``, from 0 to at most ``N``, not decreasing.
        scale: softmax scale, default ``1 / sqrt(D)``.

    Rows past ``query_start_loc[-1]`` come back as zeros. Equal to :func:`ragged_paged_attention_ref`.
    """
    check_paged(q, k_cache, v_cache, "[N, Hq, D]")
    check_kernel_device("q", q)
    for name, t, dims in (
        ("block_tables", block_tables, 2),
        ("seq_lens", seq_lens, 1),
        ("query_start_loc", query_start_loc, 1),
    ):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype != torch.int32:
            raise ValueError(f"{name} must be an int32 tensor of {dims} dimension(s)")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    b = seq_lens.shape[0]
    if b == 0 or query_start_loc.shape[0] != b + 1 or block_tables.shape[0] != b:
        raise ValueError(
            f"query_start_loc needs {b + 1} entries and block_tables {b} rows for {b} sequences, got "
            f"{query_start_loc.shape[0]} and {block_tables.shape[0]}"
        )
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()  # checked on the host, as every checked entry point
    q_lens = [hi - lo for lo, hi in zip(qsl, qsl[1:])]
    if qsl[0] != 0 or min(q_lens) < 0 or qsl[-1] > q.shape[0]:
        raise ValueError(f"query_start_loc must rise from 0 to at most {q.shape[0]} (q's rows), got {qsl}")
    if any(n < k for n, k in zip(lens, q_lens)):
        raise ValueError(f"seq_lens must count at least each sequence's new rows: {lens} for {q_lens} new")
    block_size = k_cache.shape[1]
    needed = max(-(-n // block_size) for n in lens)
    if needed > block_tables.shape[1]:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns; seq_lens need {needed}")
    used = [row[: -(-n // block_size)] for row, n in zip(block_tables.tolist(), lens)]
    if any(not 0 <= x < k_cache.shape[0] for row in used for x in row):
        raise ValueError(f"block_tables name a block outside the pool's {k_cache.shape[0]}")
    scale = _default_scale(scale, q.shape[-1])
    q = q if q.stride(-1) == 1 else q.contiguous()

    def launch() -> torch.Tensor:
        return ragged_paged(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=torch.zeros_like(q)
        )

    config = (q.dtype, q.shape[-1], q.shape[1] // k_cache.shape[2], block_size)
    return launch_or_fallback(
        "ragged_paged_attention",
        q.device,
        config,
        launch,
        lambda: ragged_paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale),
    )
