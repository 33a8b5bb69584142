"""Attention backends: where a layer's new K/V go, and which K/V its queries read.

The model computes ``q, k, v`` for its new tokens (RoPE applied) and hands them to one callable:

    out = attn(layer_idx, q, k, v)      # q [B, T, Hq, D], k, v [B, T, Hkv, D] -> [B, T, Hq, D]

Everything about caches lives behind that call, so the same model runs three ways:

* :class:`NoCache` -- chapter 1's naive loop: attend over this forward's own tokens, keep nothing;
* :class:`ContiguousBackend` -- chapter 2's :class:`~kvcourse.KVCache`: append, attend over the history;
* :class:`PagedTorchBackend` -- chapter 4 on: a ragged :class:`~kvcourse.batch.ForwardBatch` of many
  sequences; new K/V scattered into a paged pool through ``slot_mapping``, queries reading the pool
  through ``block_tables``. Chapter 5's ``"triton"`` backend replaces its decode and write paths.

A backend is built once per forward step, before any layer runs, with everything it needs (the
cache and the start position, or the pool and the batch). The layers never allocate memory and never
depend on the order in which they run. Causal masks come from token positions.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from .batch import ForwardBatch
from .kernels.reference import causal_attention, paged_attention, position_masked_attention, reshape_and_cache_ref

__all__ = [
    "AttentionBackend",
    "ContiguousBackend",
    "KVCacheLike",
    "NoCache",
    "PAGED_BACKENDS",
    "PagedTorchBackend",
    "paged_backend",
]


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


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
        """Chapter 7: the cache returned some of the past, in any order, and says at which positions."""
        k_pos = self.key_positions(layer_idx)
        if k_pos.shape[-1] != k_all.shape[2]:
            raise ValueError(f"cache.key_positions({layer_idx}) gives {k_pos.shape[-1]} positions but "
                             f"cache.update returned {k_all.shape[2]} keys")  # fmt: skip
        q_pos = torch.arange(self.start, self.start + q.shape[2], device=q.device)
        if self.observe_attention is None:
            return _heads_first(position_masked_attention(q, k_all, v_all, q_pos, k_pos))
        out, probs = position_masked_attention(q, k_all, v_all, q_pos, k_pos, return_probs=True)
        self.observe_attention(layer_idx, probs)
        return _heads_first(out)


class PagedTorchBackend:
    """A ragged batch on a paged pool, in plain torch (the reference every faster backend must equal).

    Per layer: write the new K/V into their slots, then attend. Sequences with one new token (decodes)
    are attended together; each prefill or prefill chunk is attended on its own.
    """

    def __init__(self, kv_pool, batch: ForwardBatch) -> None:
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        self.pool, self.batch = kv_pool, batch
        qsl, lens = batch.query_start_loc_host, batch.seq_lens_host
        # Split the batch once per step, on the host, so no layer has to ask the device.
        self.decode_seqs = [b for b in range(batch.num_seqs) if qsl[b + 1] - qsl[b] == 1]
        self.prefill_seqs = [b for b in range(batch.num_seqs) if qsl[b + 1] - qsl[b] > 1]
        device = batch.input_ids.device
        idx = torch.tensor(self.decode_seqs, dtype=torch.int64, device=device)
        self.all_decode = len(self.decode_seqs) == batch.num_seqs
        self.decode_rows = batch.query_start_loc[:-1].to(torch.int64)[idx]  # each decode's row in the batch
        self.decode_tables = batch.block_tables[idx]
        self.decode_lens = batch.seq_lens[idx]
        self.decode_max_len = max((lens[b] for b in self.decode_seqs), default=0)
        self.scale = 1.0 / math.sqrt(kv_pool.head_dim)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q[0], k[0], v[0]  # the batch is one packed row: [N, H, D]
        self.write_kv(layer_idx, k, v)
        if self.all_decode:  # the common serving step: one token per sequence, rows in order
            return self.decode(layer_idx, q)[None]
        out = torch.empty_like(q)
        if self.decode_seqs:
            out[self.decode_rows] = self.decode(layer_idx, q[self.decode_rows])
        qsl = self.batch.query_start_loc_host
        for b in self.prefill_seqs:
            out[qsl[b] : qsl[b + 1]] = self.prefill(layer_idx, q, b)
        return out[None]

    # ---- the three operations a faster backend may replace ------------------------------------
    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter the new tokens' K/V into their slots (vLLM's ``reshape_and_cache``)."""
        k_cache, v_cache = self.pool.k_cache[layer_idx], self.pool.v_cache[layer_idx]
        reshape_and_cache_ref(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache,
                              self.batch.slot_mapping, check=False)  # fmt: skip

    def decode(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """One query per decoding sequence, ``q [Bd, Hq, D]``, against its blocks."""
        lens = self.decode_lens
        out = paged_attention(
            q[:, None], (lens.to(torch.int64) - 1)[:, None], self.pool.k_cache[layer_idx],
            self.pool.v_cache[layer_idx], self.decode_tables, lens, self.scale, self.decode_max_len,
        )  # fmt: skip
        return out[:, 0]

    def prefill(self, layer_idx: int, q: torch.Tensor, b: int) -> torch.Tensor:
        """Sequence ``b``'s chunk of queries against its blocks (the chunk's own K/V already written)."""
        lo, hi = self.batch.query_start_loc_host[b], self.batch.query_start_loc_host[b + 1]
        out = paged_attention(
            q[None, lo:hi], self.batch.positions[None, lo:hi], self.pool.k_cache[layer_idx],
            self.pool.v_cache[layer_idx], self.batch.block_tables[b : b + 1], self.batch.seq_lens[b : b + 1],
            self.scale, self.batch.seq_lens_host[b],
        )  # fmt: skip
        return out[0]


PAGED_BACKENDS: dict[str, type] = {"paged-torch": PagedTorchBackend}


def paged_backend(name: str, kv_pool, batch: ForwardBatch) -> AttentionBackend:
    """The paged backend called ``name`` for one step of ``batch`` on ``kv_pool``."""
    if name == "triton" and name not in PAGED_BACKENDS:  # chapter 5: import Triton only when asked for
        from .kernels.triton_backend import TritonBackend

        PAGED_BACKENDS[name] = TritonBackend
    if name == "triton-int8" and name not in PAGED_BACKENDS:  # chapter 7's int8 pool through chapter 5's kernels
        from .compression.triton_int8 import TritonInt8Backend

        PAGED_BACKENDS[name] = TritonInt8Backend
    if name not in PAGED_BACKENDS:
        raise ValueError(f"backend must be one of {sorted({*PAGED_BACKENDS, 'triton', 'triton-int8'})}, got {name!r}")
    return PAGED_BACKENDS[name](kv_pool, batch)
