"""The online softmax and the split-KV merge, one step at a time in torch: what the kernels compute.

Softmax attention of one query over ``S`` keys needs the maximum score before it can exponentiate
anything (``exp`` of raw scores overflows). A kernel that reads K and V tile by tile does not know
that maximum until the last tile. The online softmax (Milakov and Gimelshein, 2018; the core of
FlashAttention) keeps three running values and fixes the past whenever the maximum grows:

    m   = max of the scores seen so far
    l   = sum over seen keys of exp(s_j - m)
    acc = sum over seen keys of exp(s_j - m) * v_j

A new tile with scores ``s`` and values ``V``: ``m' = max(m, max(s))``, ``alpha = exp(m - m')``, then
``l' = alpha l + sum exp(s - m')`` and ``acc' = alpha acc + exp(s - m') V``. After the last tile the
output is ``acc / l``, and ``lse = m + log(l)`` is the log of the softmax's denominator.

Split-KV (flash-decoding) runs this over separate ranges of keys and merges the results with their
``lse`` (:func:`merge_partials`), exactly.
"""

from __future__ import annotations

import torch

__all__ = ["merge_partials", "online_softmax_attention"]


def online_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile: int,
    scale: float = 1.0,
    trace: list[dict] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries ``q [G, D]`` over ``k, v [S, D]``, reading ``tile`` keys at a time.

    Returns ``(out [G, D], lse [G])`` in float64, equal to ``softmax(scale q k^T) v`` and
    ``logsumexp(scale q k^T)``. ``S = 0`` gives ``out = 0`` and ``lse = -inf`` (an empty split).
    ``trace``, a list, receives one dict per tile with the running values of query 0
    (``start``, ``tile_max``, ``m``, ``alpha``, ``l``).
    """
    if q.ndim != 2 or k.ndim != 2 or v.shape != k.shape or q.shape[1] != k.shape[1]:
        raise ValueError(f"need q [G, D] and k, v [S, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be a positive int, got {tile!r}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    q, k, v = q.double(), k.double(), v.double()
    m = torch.full((q.shape[0],), float("-inf"), dtype=torch.float64, device=q.device)
    l = torch.zeros(q.shape[0], dtype=torch.float64, device=q.device)
    acc = torch.zeros_like(q)
    for start in range(0, k.shape[0], tile):
        s = scale * q @ k[start : start + tile].T  # [G, tile]
        m_new = torch.maximum(m, s.amax(dim=1))
        alpha = torch.exp(m - m_new)  # how much the old maximum overstated: shrink the past by it
        p = torch.exp(s - m_new[:, None])
        l = alpha * l + p.sum(dim=1)
        acc = alpha[:, None] * acc + p @ v[start : start + tile]
        m = m_new
        if trace is not None:
            trace.append(
                dict(start=start, tile_max=float(s[0].max()), m=float(m[0]), alpha=float(alpha[0]), l=float(l[0]))
            )
    if k.shape[0] == 0:
        return acc, m  # nothing seen: 0 and -inf
    return acc / l[:, None], m + torch.log(l)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Merge split results: ``outs [splits, ..., D]`` (each normalised over its keys), ``lses [splits, ...]``.

    The weight of split ``i`` is its share of the softmax denominator, ``exp(lse_i) / sum_j exp(lse_j)``,
    computed as ``exp(lse_i - M)`` with ``M = max_j lse_j`` to stay finite. Empty splits
    (``lse = -inf``) weigh 0; at least one split must be non-empty.
    """
    if outs.shape[:-1] != lses.shape:
        raise ValueError(
            f"outs [splits, ..., D] and lses [splits, ...] disagree: {list(outs.shape)}, {list(lses.shape)}"
        )
    if lses.device != outs.device:
        raise ValueError(f"outs and lses must be on one device, got {outs.device} and {lses.device}")
    if bool(torch.isneginf(lses).all(dim=0).any()):
        raise ValueError("every split of some row is empty (lse = -inf): nothing to merge")
    w = torch.exp(lses - lses.amax(dim=0))
    return (w[..., None] * outs).sum(dim=0) / w.sum(dim=0)[..., None]
