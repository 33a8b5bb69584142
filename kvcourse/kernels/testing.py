"""Random ragged, paged attention problems with known answers: the harness every attention test uses.

:func:`random_paged_case` scatters the K/V of ``B`` sequences over a shuffled pool (random,
non-contiguous block tables, optionally blocks shared between sequences), fills every slot no
sequence owns with NaN, pads the block tables with -1, and keeps the same K/V laid out contiguously
so :meth:`PagedCase.expected` can answer with the plain contiguous references. A paged
implementation that reads a slot it should not, or mixes up two sequences, gives NaN or a wrong
number: both fail ``torch.testing.assert_close``.

Everything is drawn from a ``torch.Generator`` seeded with ``seed``: the same case on any machine,
in any test order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .reference import causal_attention, slot_mapping

__all__ = ["PagedCase", "paged_from_contiguous", "random_paged_case", "repage", "tolerance"]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``assert_close`` tolerances for attention outputs computed in ``dtype`` (from its precision)."""
    return {
        torch.float64: dict(rtol=1e-10, atol=1e-10),
        torch.float32: dict(rtol=1e-5, atol=1e-5),
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    }[dtype]


@dataclass
class PagedCase:
    """One problem. ``q`` is ``[N, Hq, D]`` (``N = B`` for decode); the rest as in :mod:`.reference`."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with -1
    seq_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    positions: torch.Tensor  # int64 [N]
    slot_mapping: torch.Tensor  # int64 [N]: where this step's queries' own K/V sit
    k: torch.Tensor  # contiguous [B, Hkv, max(seq_lens), D], zero past each seq_len
    v: torch.Tensor
    scale: float | None = None

    def expected(self) -> torch.Tensor:
        """The answer from the contiguous causal reference, one sequence at a time: ``[N, Hq, D]``."""
        out = torch.empty_like(self.q)
        qsl, lens = self.query_start_loc.tolist(), self.seq_lens.tolist()
        for b, (lo, hi) in enumerate(zip(qsl, qsl[1:])):
            q = self.q[lo:hi].transpose(0, 1)[None]  # [1, Hq, T, D]
            k, v = self.k[b : b + 1, :, : lens[b]], self.v[b : b + 1, :, : lens[b]]
            out[lo:hi] = causal_attention(q, k, v, self.scale, q_offset=lens[b] - (hi - lo))[0].transpose(0, 1)
        return out


def random_paged_case(
    seed: int,
    seq_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: Sequence[int] | None = None,
    shared_blocks: int = 0,
    spare_blocks: int = 2,
    extra_table_columns: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    scale: float | None = None,
) -> PagedCase:
    """A random paged attention problem.

    Args:
        seed: seeds every random draw.
        seq_lens: context length of each sequence (cached tokens, this step's included).
        query_lens: new tokens per sequence, the tail of its context; default 1 each (decode).
        shared_blocks: every sequence's first ``shared_blocks`` blocks are sequence 0's (a shared
            prefix, as after a fork); all sequences must be at least that many full blocks long.
        spare_blocks: blocks no sequence owns (filled with NaN).
        extra_table_columns: padding columns (-1) at the end of every block table.
    """
    # Drawn on the host (the same case on every machine), moved to ``device`` at the end.
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq_lens = list(seq_lens)
    query_lens = [1] * len(seq_lens) if query_lens is None else list(query_lens)
    if len(query_lens) != len(seq_lens) or not all(1 <= q <= s for q, s in zip(query_lens, seq_lens)):
        raise ValueError(f"need 1 <= query_lens[b] <= seq_lens[b], got {query_lens} and {seq_lens}")
    shared = shared_blocks * block_size
    if shared and min(n - q for n, q in zip(seq_lens, query_lens)) < shared:
        raise ValueError(f"shared_blocks={shared_blocks}: every sequence's cached part must cover {shared} tokens")
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    owned = [nb - (shared_blocks if b else 0) for b, nb in enumerate(blocks_per_seq)]
    num_blocks = sum(owned) + spare_blocks
    physical = torch.randperm(num_blocks, generator=g, device="cpu").tolist()  # scattered, not contiguous
    tables = []
    for b, nb in enumerate(owned):
        own = [physical.pop() for _ in range(nb)]
        tables.append(tables[0][:shared_blocks] + own if b else own)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cpu").to(dtype)

    hkv, d, s_max = num_kv_heads, head_dim, max(seq_lens)
    k = torch.zeros(len(seq_lens), hkv, s_max, d, dtype=dtype, device="cpu")
    v = torch.zeros_like(k)
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device="cpu")
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, n in enumerate(seq_lens):
        k[b, :, :n], v[b, :, :n] = randn(hkv, n, d), randn(hkv, n, d)
        if b and shared:  # a shared prefix holds sequence 0's K/V
            k[b, :, :shared], v[b, :, :shared] = k[0, :, :shared], v[0, :, :shared]
        slots = torch.tensor(slot_mapping(tables[b], range(n), block_size), device="cpu")
        k_cache.view(-1, hkv, d)[slots] = k[b, :, :n].transpose(0, 1)
        v_cache.view(-1, hkv, d)[slots] = v[b, :, :n].transpose(0, 1)

    width = max(blocks_per_seq) + extra_table_columns
    padded = [t + [-1] * (width - len(t)) for t in tables]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    positions = [p for n, q in zip(seq_lens, query_lens) for p in range(n - q, n)]
    own_slots = [
        s for t, n, q in zip(tables, seq_lens, query_lens) for s in slot_mapping(t, range(n - q, n), block_size)
    ]
    case = PagedCase(
        q=randn(qsl[-1], num_q_heads, d),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.tensor(padded, dtype=torch.int32, device="cpu"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cpu"),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cpu"),
        positions=torch.tensor(positions, dtype=torch.int64, device="cpu"),
        slot_mapping=torch.tensor(own_slots, dtype=torch.int64, device="cpu"),
        k=k,
        v=v,
        scale=scale,
    )
    for name in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc", "positions",
                 "slot_mapping", "k", "v"):  # fmt: skip
        setattr(case, name, getattr(case, name).to(device))
    return case


def repage(case: PagedCase, block_size: int, seed: int, spare_blocks: int = 2) -> PagedCase:
    """The same decode problem (same ``q``, K/V values, ``seq_lens``) scattered over a new pool.

    Only the *layout* changes, so a correct paged kernel gives the same output on both. ``case``
    must be a decode case (one query per sequence).
    """
    if case.q.shape[0] != case.seq_lens.shape[0]:
        raise ValueError("repage takes a decode case (one query per sequence)")
    return paged_from_contiguous(
        case.q, case.k, case.v, case.seq_lens.tolist(), block_size, seed, spare_blocks, case.scale
    )


def paged_from_contiguous(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: Sequence[int],
    block_size: int,
    seed: int,
    spare_blocks: int = 2,
    scale: float | None = None,
) -> PagedCase:
    """A decode problem given contiguously (``q [B, Hq, D]``, ``k, v [B, Hkv, S, D]``), laid out in a paged pool.

    Sequence ``b``'s first ``seq_lens[b]`` positions go to blocks of ``block_size`` tokens in a random
    order (seeded by ``seed``); every unused slot holds NaN; tables are padded with one -1 column.
    """
    lens = [int(n) for n in seq_lens]
    if len(lens) != q.shape[0] or k.shape[0] != q.shape[0] or any(not 1 <= n <= k.shape[2] for n in lens):
        raise ValueError(f"need one seq_len in [1, {k.shape[2]}] per sequence of q, got {lens}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks, generator=g, device="cpu").tolist()
    tables = [[physical.pop() for _ in range(nb)] for nb in blocks_per_seq]
    hkv, d = k.shape[1], k.shape[3]
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=k.dtype, device=k.device)
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, n in enumerate(lens):
        slots = torch.tensor(slot_mapping(tables[b], range(n), block_size), device=k.device)
        k_cache.view(-1, hkv, d)[slots] = k[b, :, :n].transpose(0, 1)
        v_cache.view(-1, hkv, d)[slots] = v[b, :, :n].transpose(0, 1)
    width = max(blocks_per_seq) + 1
    own_slots = [slot_mapping(t, [n - 1], block_size)[0] for t, n in zip(tables, lens)]
    device = k.device
    return PagedCase(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device=device),
        positions=torch.tensor([n - 1 for n in lens], dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(own_slots, dtype=torch.int64, device=device),
        k=k,
        v=v,
        scale=scale,
    )
