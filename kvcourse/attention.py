"""Reference attention in plain torch, with grouped-query attention (GQA).

Two functions, the two shapes attention takes during generation:

* :func:`causal_attention` -- every query of a sequence against every key at or
  before it (the naive loop and prefill both do this);
* :func:`decode_attention_ref` -- one new query per sequence against the keys and
  values already in the cache (decode does this).

Layout follows the serving engines: ``[batch, heads, tokens, head_dim]``.
With GQA, ``Hq`` query heads share ``Hkv`` key/value heads: query head ``h``
reads KV head ``h // (Hq // Hkv)``.

These are the ground truth that every faster path in the course (the cached
model, the paged cache, the Triton kernels) is tested against, so they favour
clarity and strict input checks over speed.
"""

from __future__ import annotations

import math

import torch

__all__ = ["causal_attention", "decode_attention_ref", "repeat_kv", "check_qkv"]


def _check_tensor(name: str, t: object, ndim: int, shape_doc: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim} {shape_doc}, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_shape_doc: str) -> tuple[int, int]:
    """Validate a GQA (q, k, v) triple; return ``(Hq, Hkv)``.

    ``q`` may be ``[B, Hq, T, D]`` or ``[B, Hq, D]``; ``k`` and ``v`` are
    ``[B, Hkv, S, D]``. Raises ``TypeError``/``ValueError`` naming the argument.
    """
    _check_tensor("q", q, len(q_shape_doc.split(",")), q_shape_doc)
    _check_tensor("k", k, 4, "[B, Hkv, S, D]")
    _check_tensor("v", v, 4, "[B, Hkv, S, D]")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has dtype {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on one device")
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


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand ``[B, Hkv, S, D]`` to ``[B, Hkv * n_rep, S, D]`` so each query head has its KV head.

    This is a copy for clarity; a kernel reads the shared head in place instead.
    """
    if n_rep == 1:
        return x
    b, hkv, s, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, q_offset: int | None = None
) -> torch.Tensor:
    """Causal softmax attention, ``q [B, Hq, T, D]``, ``k, v [B, Hkv, S, D]`` -> ``[B, Hq, T, D]``.

    Query ``i`` sits at absolute position ``q_offset + i`` and may attend to keys
    ``0 .. q_offset + i``. ``q_offset`` defaults to ``S - T``: the queries are the
    last ``T`` tokens, which covers both a whole sequence (``S == T``) and a new
    chunk appended to a cache.
    """
    hq, hkv = check_qkv(q, k, v, "[B, Hq, T, D]")
    t, s = q.shape[2], k.shape[2]
    if q_offset is None:
        q_offset = s - t
    if q_offset < 0 or q_offset + t > s:
        raise ValueError(f"q_offset={q_offset} with {t} queries does not fit in {s} keys")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, _, _, d = q.shape
    n_rep = hq // hkv
    # Stack each KV head's query heads along the token axis, [B, Hkv, n_rep * T, D], so every group
    # reads its shared K and V in place: the same result as repeat_kv, without copying the cache.
    q_grouped = (q * scale).reshape(b, hkv, n_rep * t, d)
    scores = q_grouped @ k.transpose(-1, -2)  # [B, Hkv, n_rep * T, S]
    if t > 1 or q_offset != s - 1:  # one query at the end sees every key: nothing to mask
        q_pos = torch.arange(t, device=q.device)[:, None] + q_offset
        k_pos = torch.arange(s, device=q.device)[None, :]
        future = (k_pos > q_pos).repeat(n_rep, 1)  # [n_rep * T, S], the causal mask for each group
        scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (probs @ v).reshape(b, hq, t, d)


def decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor | list[int] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step: ``q [B, Hq, D]`` against cached ``k, v [B, Hkv, S, D]`` -> ``[B, Hq, D]``.

    ``seq_lens[b]`` is how many cached tokens sequence ``b`` really has (the rest
    of its ``S`` slots are padding); ``None`` means all ``S``. No causal mask is
    needed: the new token is the last one, so it may see every cached token.
    """
    hq, hkv = check_qkv(q, k, v, "[B, Hq, D]")
    batch, s = q.shape[0], k.shape[2]
    if seq_lens is None:
        lens = torch.full((batch,), s, device=q.device)
    else:
        lens = torch.as_tensor(seq_lens, device=q.device)
        if lens.shape != (batch,):
            raise ValueError(f"seq_lens must have shape [B]=[{batch}], got {tuple(lens.shape)}")
        if bool((lens < 1).any()) or bool((lens > s).any()):
            raise ValueError(f"seq_lens must lie in [1, {s}] (the cache length), got {lens.tolist()}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = repeat_kv(k, hq // hkv), repeat_kv(v, hq // hkv)
    scores = torch.einsum("bhd,bhsd->bhs", q, k) * scale
    valid = torch.arange(s, device=q.device)[None, :] < lens[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("bhs,bhsd->bhd", probs, v)
