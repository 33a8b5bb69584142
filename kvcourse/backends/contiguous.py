"""Chapters 1-2 (and chapter 8's windows and dropping caches): one batch of equal-length sequences.

* :class:`NoCache` -- attend over this forward's own tokens, keep nothing;
* :class:`ContiguousBackend` -- a :class:`~kvcourse.KVCache`-like cache: append, attend over the history.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..kernels.reference import causal_attention, position_masked_attention

__all__ = ["ContiguousBackend", "KVCacheLike", "NoCache"]


class KVCacheLike(Protocol):
    """What a contiguous cache gives the model: the tokens it holds, and an append that returns the history.

    ``seq_len`` is the number of tokens the sequence has so far (the next token's position). A cache that
    keeps only some of them (a sliding window, attention sinks, dropped tokens) also has
    ``key_positions(layer_idx)``: the position of each key ``update`` returned, ``[S]`` or ``[B, H_kv, S]``;
    attention then masks by those positions. If it also has ``observe_attention(layer_idx, probs)``, it is
    handed each layer's attention weights ``[B, Hq, T, S]`` (to score tokens for eviction).
    """

    @property
    def seq_len(self) -> int: ...

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, T, H, D] <-> [B, H, T, D]


class NoCache:
    """No cache: the forward sees the whole sequence, positions ``0 .. T-1``, and recomputes every K/V."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _heads_first(causal_attention(_heads_first(q), _heads_first(k), _heads_first(v), q_offset=0))


class ContiguousBackend:
    """A contiguous cache holding ``start`` tokens; this forward's tokens sit at positions ``start ..``."""

    def __init__(self, cache: KVCacheLike, start: int) -> None:
        self.cache, self.start = cache, start
        # Looked up once per forward: a cache without key_positions takes the unchanged fast path.
        self.key_positions = getattr(cache, "key_positions", None)
        self.observe_attention = getattr(cache, "observe_attention", None)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Store this step's K/V and get back the whole history: the heart of chapter 2.
        k_all, v_all = self.cache.update(layer_idx, _heads_first(k), _heads_first(v))
        if self.key_positions is not None:
            return self.attend_by_positions(layer_idx, _heads_first(q), k_all, v_all)
        if k_all.shape[2] != self.start + k.shape[1]:
            raise ValueError(
                f"cache.update(layer {layer_idx}) returned {k_all.shape[2]} keys, but the cache held "
                f"seq_len={self.start} tokens before this forward and {k.shape[1]} were added: expected "
                f"{self.start + k.shape[1]}"
            )
        out = causal_attention(_heads_first(q), k_all, v_all, q_offset=self.start)
        return _heads_first(out)

    def attend_by_positions(self, layer_idx: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor):
        """Chapter 8: the cache returned some of the past, in any order, and says at which positions."""
        k_pos = self.key_positions(layer_idx)
        if k_pos.shape[-1] != k_all.shape[2]:
            raise ValueError(
                f"cache.key_positions({layer_idx}) gives {k_pos.shape[-1]} positions but "
                f"cache.update returned {k_all.shape[2]} keys"
            )
        q_pos = torch.arange(self.start, self.start + q.shape[2], device=q.device)
        if self.observe_attention is None:
            return _heads_first(position_masked_attention(q, k_all, v_all, q_pos, k_pos))
        out, probs = position_masked_attention(q, k_all, v_all, q_pos, k_pos, return_probs=True)
        self.observe_attention(layer_idx, probs)
        return _heads_first(out)
