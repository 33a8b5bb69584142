"""Torch references for every attention the course computes: slow where it must be, obviously right.

Three layouts, the three ways K and V are stored in this course:

* **contiguous cache** (chapters 1-2): ``k, v [B, Hkv, S, D]``, position ``s`` in slot ``s``;
* **paged pool** (chapter 4 on): ``k_cache, v_cache [num_blocks, block_size, Hkv, D]``, a sequence's
  positions spread over the blocks its **block table** lists;
* **ragged batch** (a serving step): the new tokens of every sequence packed into one row,
  ``q [N, Hq, D]``, sequence ``b`` owning rows ``query_start_loc[b] : query_start_loc[b + 1]``.

With GQA, ``Hq`` query heads share ``Hkv`` KV heads: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
Every mask is built from **positions**: a query at position ``p`` sees the keys at positions ``0 .. p``
of its own sequence, whatever else is in the batch or the cache.

The paged functions read K and V block by block through the block table, a tile of blocks at a time,
as chapter 5's kernels do; they never copy a sequence's whole history into a contiguous tensor.
Softmax is computed over the whole row at once (two passes over the tiles), so the references need no
online-softmax rescaling: chapter 5 derives that and checks it against these.

Arithmetic runs in float32, or in the input dtype when that is wider (float64 tests stay float64).
Each function checks its inputs strictly unless called with ``check=False``, which a caller that has
validated the whole step once (:class:`kvcourse.batch.ForwardBatch`) uses to avoid a host-device
synchronisation per layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..checks import check_int

__all__ = [
    "KV_TILE_TOKENS",
    "causal_attention",
    "decode_attention_ref",
    "paged_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention_ref",
    "position_masked_attention",
    "repeat_kv",
    "reshape_and_cache_ref",
    "slot_mapping",
]

# Token slots read per step of the tile loop: bounds the K/V workspace whatever the context length.
KV_TILE_TOKENS = 512


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention arithmetic runs in: at least float32, never below the input's precision."""
    return torch.promote_types(dtype, torch.float32)


def _default_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    return float(scale)


# ---------------------------------------------------------------------------------------------
# Input checks (one place, shared by every reference)
# ---------------------------------------------------------------------------------------------
def _check_float(name: str, t: object, ndim: int, doc: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {doc}, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor {doc}, got dtype {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim} {doc}, got shape {tuple(t.shape)}")
    return t


def _check_int(name: str, t: object, ndim: int, doc: str, dtypes=(torch.int32,)) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor {doc}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        wanted = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {wanted} {doc} (use .to({dtypes[0]})), got {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim} {doc}, got shape {tuple(t.shape)}")
    return t


def _same_place(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str, dtype: bool = True) -> None:
    if dtype and t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must be on one device")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_shape_doc: str) -> tuple[int, int]:
    """Validate a contiguous GQA triple: ``q [B, Hq, T, D]`` or ``[B, Hq, D]``, ``k, v [B, Hkv, S, D]``.

    Returns ``(Hq, Hkv)``; raises ``TypeError``/``ValueError`` naming the argument.
    """
    _check_float("q", q, len(q_shape_doc.split(",")), q_shape_doc)
    _check_float("k", k, 4, "[B, Hkv, S, D]")
    _check_float("v", v, 4, "[B, Hkv, S, D]")
    _same_place("k", k, q, "q")
    _same_place("v", v, q, "q")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    batch, hq, head_dim = q.shape[0], q.shape[1], q.shape[-1]
    if k.shape[0] != batch:
        raise ValueError(f"k has batch size {k.shape[0]} but q has {batch}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k has head_dim {k.shape[-1]} but q has {head_dim}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads in q ({hq}) must be a multiple of the number of KV heads in k ({hkv})"
        )
    return hq, hkv


def check_paged(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_doc: str, num_seqs: int | None = None
) -> None:
    """Validate a query against one layer's paged pool ``[num_blocks, block_size, Hkv, D]``."""
    pool_doc = "[num_blocks, block_size, Hkv, D]"
    _check_float("q", q, len(q_doc.split(",")), q_doc)
    _check_float("k_cache", k_cache, 4, pool_doc)
    _check_float("v_cache", v_cache, 4, pool_doc)
    _same_place("k_cache", k_cache, q, "q")
    _same_place("v_cache", v_cache, q, "q")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    hq, head_dim = q.shape[-2], q.shape[-1]
    hkv, cache_dim = k_cache.shape[2], k_cache.shape[3]
    if cache_dim != head_dim:
        raise ValueError(f"k_cache has head_dim {cache_dim} but q has {head_dim}")
    if hq % hkv:
        raise ValueError(f"the number of query heads in q ({hq}) must be a multiple of the KV heads in k_cache ({hkv})")


def check_seq_lens(
    seq_lens: torch.Tensor | list[int] | None, batch: int, cache_len: int, device: torch.device
) -> torch.Tensor:
    """Validate the cached length of each sequence of a contiguous cache; ``None`` means all ``cache_len``."""
    if seq_lens is None:
        return torch.full((batch,), cache_len, device=device)
    lens = torch.as_tensor(seq_lens, device=device)
    if lens.shape != (batch,):
        raise ValueError(f"seq_lens must have shape [B]=[{batch}], got {tuple(lens.shape)}")
    if bool((lens < 1).any()) or bool((lens > cache_len).any()):
        raise ValueError(f"seq_lens must lie in [1, {cache_len}] (the cache length), got {lens.tolist()}")
    return lens


def check_block_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int, device: torch.device
) -> list[int]:
    """Validate ``block_tables int32 [B, max_blocks]`` and ``seq_lens int32 [B]``; return seq_lens as ints.

    Each used entry (the first ``ceil(seq_lens[b] / block_size)`` of row ``b``) must name a block of
    the pool; the rest of a row is padding and is never read.
    """
    _check_int("block_tables", block_tables, 2, "[B, max_blocks]")
    _check_int("seq_lens", seq_lens, 1, "[B]")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}; they must be on one device")
    if seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but block_tables has {block_tables.shape[0]} rows")
    lens = seq_lens.tolist()
    tables = block_tables.tolist()
    max_blocks = block_tables.shape[1]
    for b, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"seq_lens[{b}] must be >= 1, got {n}")
        used = -(-n // block_size)
        if used > max_blocks:
            raise ValueError(
                f"block_tables[{b}] has {max_blocks} entries, too short for seq_lens[{b}]={n} "
                f"({used} blocks of {block_size})"
            )
        bad = [x for x in tables[b][:used] if not 0 <= x < num_blocks]
        if bad:
            raise ValueError(
                f"block_tables[{b}] points outside the pool [0, {num_blocks}) in its used entries: {bad[:5]}"
            )
    return lens


# ---------------------------------------------------------------------------------------------
# Contiguous cache
# ---------------------------------------------------------------------------------------------
def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand ``[B, Hkv, S, D]`` to ``[B, Hkv * n_rep, S, D]`` so each query head has its KV head.

    This is a copy for clarity; the functions below and the kernels read the shared head in place.
    """
    if n_rep == 1:
        return x
    b, hkv, s, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, q_offset: int | None = None
) -> torch.Tensor:
    """Causal softmax attention, ``q [B, Hq, T, D]``, ``k, v [B, Hkv, S, D]`` -> ``[B, Hq, T, D]``.

    Key ``j`` sits at position ``j``; query ``i`` sits at position ``q_offset + i`` and sees the keys
    at positions ``0 .. q_offset + i``. ``q_offset`` defaults to ``S - T`` (the queries are the last
    ``T`` keys: a whole sequence, or a chunk just appended to a cache); the model passes it explicitly.
    """
    hq, hkv = check_qkv(q, k, v, "[B, Hq, T, D]")
    t, s = q.shape[2], k.shape[2]
    if q_offset is None:
        q_offset = s - t
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0 or q_offset + t > s:
        raise ValueError(f"q_offset={q_offset!r} with {t} queries does not fit in {s} keys")
    scale = _default_scale(scale, q.shape[-1])
    b, _, _, d = q.shape
    n_rep = hq // hkv
    # Stack each KV head's query heads along the token axis, [B, Hkv, n_rep * T, D], so every group
    # reads its shared K and V in place: the same result as repeat_kv, without copying the cache.
    q_grouped = (q * scale).reshape(b, hkv, n_rep * t, d)
    scores = q_grouped @ k.transpose(-1, -2)  # [B, Hkv, n_rep * T, S]
    if t > 1 or q_offset != s - 1:  # a lone query at the last position sees every key: no mask
        q_pos = torch.arange(t, device=q.device)[:, None] + q_offset
        k_pos = torch.arange(s, device=q.device)[None, :]
        future = (k_pos > q_pos).repeat(n_rep, 1)  # [n_rep * T, S], the causal mask for each group
        scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores.to(compute_dtype(q.dtype)), dim=-1).to(q.dtype)
    return (probs @ v).reshape(b, hq, t, d)


def position_masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float | None = None,
    return_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over keys that carry their own positions: ``q [B, Hq, T, D]`` -> ``[B, Hq, T, D]``.

    For a cache that keeps only some of the past (a sliding window, attention sinks, dropped tokens),
    in any order (a ring buffer). Query ``i`` at position ``q_positions[i]`` sees key ``j`` iff
    ``k_positions[..., j] <= q_positions[i]``. ``k_positions`` is ``[S]`` (one set for every head) or
    ``[B, Hkv, S]`` (each KV head keeps its own tokens). With ``k_positions = arange(S)`` this is
    :func:`causal_attention` with ``q_offset = q_positions[0]``. ``return_probs=True`` also returns the
    attention weights ``[B, Hq, T, S]`` (what H2O and SnapKV score tokens by).
    """
    hq, hkv = check_qkv(q, k, v, "[B, Hq, T, D]")
    b, _, t, d = q.shape
    s = k.shape[2]
    for name, pos in (("q_positions", q_positions), ("k_positions", k_positions)):
        if not isinstance(pos, torch.Tensor) or pos.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be an int64 or int32 torch.Tensor, got {getattr(pos, 'dtype', type(pos))}")
        _same_place(name, pos, q, "q", dtype=False)
    if q_positions.shape != (t,):
        raise ValueError(f"q_positions must have shape [T] = [{t}], got {tuple(q_positions.shape)}")
    if k_positions.shape not in ((s,), (b, hkv, s)):
        raise ValueError(
            f"k_positions must have shape [S] = [{s}] or [B, Hkv, S] = [{b}, {hkv}, {s}], "
            f"got {tuple(k_positions.shape)}"
        )
    visible = k_positions[..., None, :] <= q_positions[:, None]  # [T, S] or [B, Hkv, T, S]
    if not bool(visible.any(-1).all()):
        raise ValueError("a query sees no key: k_positions must include each query's own position")
    scale = _default_scale(scale, d)
    n_rep = hq // hkv
    q_grouped = (q * scale).reshape(b, hkv, n_rep, t, d)  # query heads grouped by their KV head
    scores = torch.einsum("bhgtd,bhsd->bhgts", q_grouped, k)
    hidden = ~visible if visible.ndim == 2 else ~visible[:, :, None]  # broadcast over each KV head's queries
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores.to(compute_dtype(q.dtype)), dim=-1).to(q.dtype)
    out = torch.einsum("bhgts,bhsd->bhgtd", probs, v).reshape(b, hq, t, d)
    return (out, probs.reshape(b, hq, t, s)) if return_probs else out


def decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor | list[int] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step: ``q [B, Hq, D]`` against cached ``k, v [B, Hkv, S, D]`` -> ``[B, Hq, D]``.

    ``seq_lens[b]`` is how many cached tokens sequence ``b`` really has (the rest of its ``S`` slots
    are padding, never attended); ``None`` means all ``S``. The new token is the last of its
    sequence, so it sees every cached token: no causal mask is needed.
    """
    hq, hkv = check_qkv(q, k, v, "[B, Hq, D]")
    s = k.shape[2]
    lens = check_seq_lens(seq_lens, q.shape[0], s, q.device)
    scale = _default_scale(scale, q.shape[-1])
    cdt = compute_dtype(q.dtype)
    k, v = repeat_kv(k, hq // hkv).to(cdt), repeat_kv(v, hq // hkv).to(cdt)
    scores = torch.einsum("bhd,bhsd->bhs", q.to(cdt), k) * scale
    valid = torch.arange(s, device=q.device)[None, :] < lens[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    v = v.masked_fill(~valid[:, None, :, None], 0.0)  # padding may hold anything, NaN included
    return torch.einsum("bhs,bhsd->bhd", probs, v).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Paged pool
# ---------------------------------------------------------------------------------------------
def paged_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
) -> torch.Tensor:
    """The core every paged reference shares, unchecked: ``q [B, T, Hq, D]`` -> ``[B, T, Hq, D]``.

    Query ``(b, t)`` sits at position ``q_positions[b, t]`` and sees keys ``0 .. q_positions[b, t]``
    of sequence ``b`` (never beyond ``seq_lens[b] - 1``). ``max_seq_len`` (a host int, at least
    ``max(seq_lens)``) says how many block-table columns to walk.
    """
    batch, t, hq, head_dim = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    cdt = compute_dtype(q.dtype)
    qg = q.to(cdt).reshape(batch, t, hkv, hq // hkv, head_dim) * scale  # query heads grouped by KV head
    seq_lens = seq_lens.to(torch.int64)
    used_blocks = -(-max_seq_len // block_size)
    tile = max(1, KV_TILE_TOKENS // block_size)
    starts = range(0, used_blocks, tile)

    def read_tile(cache: torch.Tensor, j0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``j0 ..`` of every sequence's table, ``[B, tile * block_size, Hkv, D]``, and their positions."""
        blocks = block_tables[:, j0 : min(j0 + tile, used_blocks)].to(torch.int64)
        # Padding entries (past a sequence's own blocks) may be -1: read block 0 there instead;
        # those positions are >= seq_len, so the mask below never lets them count.
        tiles = cache[blocks.clamp_min(0)].flatten(1, 2).to(cdt)
        k_pos = j0 * block_size + torch.arange(tiles.shape[1], device=q.device)
        return tiles, k_pos

    # Pass 1: every score of the row, tile by tile; then one exact softmax over the whole row.
    scores, positions = [], []
    for j0 in starts:
        k, k_pos = read_tile(k_cache, j0)
        scores.append(torch.einsum("bthgd,bshd->bhgts", qg, k))
        positions.append(k_pos)
    s = torch.cat(scores, dim=-1)  # [B, Hkv, G, T, S]
    k_pos = torch.cat(positions)
    visible = (k_pos[None, None, :] <= q_positions[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    probs = torch.softmax(s.masked_fill(~visible[:, None, None], float("-inf")), dim=-1)

    # Pass 2: the probability-weighted sum of V, tile by tile.
    out = torch.zeros(batch, hkv, hq // hkv, t, head_dim, dtype=cdt, device=q.device)
    for j0 in starts:
        v, v_pos = read_tile(v_cache, j0)
        # Slots past seq_len hold stale or unwritten data (NaN in the tests): zero them so that
        # 0 x NaN cannot leak into the sum. A kernel simply never loads them.
        v = v.masked_fill((v_pos[None, :] >= seq_lens[:, None])[:, :, None, None], 0.0)
        lo = j0 * block_size
        out += torch.einsum("bhgts,bshd->bhgtd", probs[..., lo : lo + v.shape[1]], v)
    return out.permute(0, 3, 1, 2, 4).reshape(batch, t, hq, head_dim).to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention read through block tables: ``q [B, Hq, D]`` -> ``[B, Hq, D]``.

    Args:
        q: one query per sequence, the newest token, at position ``seq_lens[b] - 1``.
        k_cache, v_cache: one layer's pool, ``[num_blocks, block_size, Hkv, D]``; ``Hq % Hkv == 0``.
        block_tables: int32 ``[B, max_blocks]``; row ``b``'s first ``ceil(seq_lens[b] / block_size)``
            entries are sequence ``b``'s blocks, the rest is padding (any value, never read).
        seq_lens: int32 ``[B]``, tokens cached per sequence (the new one included).
        scale: softmax scale, default ``1 / sqrt(D)``.

    Equal to :func:`decode_attention_ref` on the same K/V laid out contiguously.
    """
    check_paged(q, k_cache, v_cache, "[B, Hq, D]")
    lens = check_block_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1], q.device)
    if len(lens) != q.shape[0]:
        raise ValueError(f"block_tables and seq_lens have {len(lens)} rows but q has batch size {q.shape[0]}")
    scale = _default_scale(scale, q.shape[-1])
    q_positions = (seq_lens.to(torch.int64) - 1)[:, None]
    return paged_attention(q[:, None], q_positions, k_cache, v_cache, block_tables, seq_lens, scale, max(lens))[:, 0]


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention for a ragged batch read through block tables: ``q [N, Hq, D]`` -> ``[N, Hq, D]``.

    Sequence ``b``'s queries are rows ``query_start_loc[b] : query_start_loc[b + 1]`` (a whole prompt, a
    chunk continuing an earlier one, or one decode token); ``positions[i]`` is row ``i``'s position in
    its sequence, and it sees that sequence's keys ``0 .. positions[i]``. The K/V of every key up to
    ``seq_lens[b] - 1``, this step's tokens included, must already be in the pool.
    """
    check_paged(q, k_cache, v_cache, "[N, Hq, D]")
    lens = check_block_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1], q.device)
    _check_int("query_start_loc", query_start_loc, 1, "[B + 1]")
    _check_int("positions", positions, 1, "[N]", dtypes=(torch.int64, torch.int32))
    starts = query_start_loc.tolist()
    if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(
            f"query_start_loc must have B + 1 = {len(lens) + 1} entries from 0 to N = {q.shape[0]}, got {starts}"
        )
    if any(a >= b for a, b in zip(starts, starts[1:])):
        raise ValueError(f"query_start_loc must be strictly increasing (one query or more per sequence), got {starts}")
    if positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} entries but q has N = {q.shape[0]} rows")
    pos = positions.tolist()
    for b, (lo, hi) in enumerate(zip(starts, starts[1:])):
        if min(pos[lo:hi]) < 0 or max(pos[lo:hi]) >= lens[b]:
            raise ValueError(f"positions of sequence {b} must lie in [0, seq_lens[{b}]={lens[b]}), got {pos[lo:hi]}")
    scale = _default_scale(scale, q.shape[-1])
    out = torch.empty_like(q)
    for b, (lo, hi) in enumerate(zip(starts, starts[1:])):
        out[lo:hi] = paged_attention(
            q[None, lo:hi],
            positions[None, lo:hi].to(torch.int64),
            k_cache,
            v_cache,
            block_tables[b : b + 1],
            seq_lens[b : b + 1],
            scale,
            lens[b],
        )[0]
    return out


def slot_mapping(block_table: Sequence[int], positions: Sequence[int] | range, block_size: int) -> list[int]:
    """The pool slots holding ``positions`` of a sequence with ``block_table``: the one formula.

    ``slot = block_table[pos // block_size] * block_size + pos % block_size``: offset
    ``pos % block_size`` of the physical block that holds logical block ``pos // block_size``, in a
    pool viewed as one flat array of ``num_blocks * block_size`` token slots.
    """
    check_int("block_size", block_size, min=1)
    table, positions = list(block_table), list(positions)
    limit = len(table) * block_size
    for pos in positions:
        if not 0 <= pos < limit:
            raise ValueError(
                f"positions must lie in [0, {limit}) for a block table of {len(table)} blocks of {block_size}, "
                f"got {pos}"
            )
    # Lists in, a list out, on the host (the batch computes the same in tensor ops: kvcourse.batch.slots_of).
    return [table[pos // block_size] * block_size + pos % block_size for pos in positions]


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    check: bool = True,
) -> None:
    """Write new tokens' ``key, value [N, Hkv, D]`` into the pool at ``slot_mapping [N]``, in place.

    Slot ``s`` is offset ``s % block_size`` of block ``s // block_size``; slot ``-1`` means "padding,
    write nothing" (vLLM's convention). ``check=False`` skips validation and the ``-1`` handling: the
    caller promises valid, distinct slots.
    """
    flat = (-1, key_cache.shape[2], key_cache.shape[3])  # views of the pool: writes land in place
    if not check:
        key_cache.view(flat).index_copy_(0, slot_mapping, key)
        value_cache.view(flat).index_copy_(0, slot_mapping, value)
        return
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].to(torch.int64)
    key_cache.view(flat)[idx] = key[keep]
    value_cache.view(flat)[idx] = value[keep]


def check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Validate a cache write: ``key, value [N, Hkv, D]`` into one layer's pool at ``slot_mapping [N]``."""
    pool_doc = "[num_blocks, block_size, Hkv, D]"
    _check_float("key_cache", key_cache, 4, pool_doc)
    _check_float("value_cache", value_cache, 4, pool_doc)
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache and value_cache must have one shape, got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    doc = f"[N, Hkv, D] = [N, {key_cache.shape[2]}, {key_cache.shape[3]}]"
    for name, t in (("key", key), ("value", value)):
        _check_float(name, t, 3, doc)
        if tuple(t.shape[1:]) != tuple(key_cache.shape[2:]):
            raise ValueError(f"{name} must have shape {doc}, got {list(t.shape)}")
        _same_place(name, t, key_cache, "key_cache")
    _same_place("value_cache", value_cache, key_cache, "key_cache")
    _check_int("slot_mapping", slot_mapping, 1, "[N]", dtypes=(torch.int64, torch.int32))
    if slot_mapping.device != key_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but key_cache is on {key_cache.device}")
    if key.shape != value.shape or key.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"key, value and slot_mapping must agree on N, got {list(key.shape)}, {list(value.shape)}, "
            f"{list(slot_mapping.shape)}"
        )
    slots = slot_mapping.tolist()
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    bad = [s for s in slots if not -1 <= s < num_slots]
    if bad:
        raise ValueError(f"slot_mapping entries must lie in [0, {num_slots}) or be -1 (padding), got {bad[:5]}")
    real = [s for s in slots if s >= 0]
    if len(set(real)) != len(real):
        raise ValueError("slot_mapping names one slot twice: two tokens would overwrite each other")
