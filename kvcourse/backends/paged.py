"""Paged attention in torch: a ragged step of many sequences on chapter 4's block pool.

A serving step mixes sequences that decode one token with prompts (or chunks of prompts) that feed
many. Per layer a paged backend does three things, each a method a faster backend may replace:

1. ``write_kv`` -- scatter the new tokens' K/V into their pool slots (vLLM's ``reshape_and_cache``);
2. ``decode`` -- the one-token sequences attend, all together;
3. ``prefill`` -- the prompt rows attend, all together.

Everything that depends only on the step -- which rows decode, which slots each query reads, the
masks -- is computed once, when the backend is built (once per forward), never once per layer, and
from the batch's host copies of its lengths: building a backend never waits for the device.

The model hands a paged backend the step's packed tokens without a batch dimension:
``q [N, Hq, D]``, ``k, v [N, Hkv, D]`` -> ``[N, Hq, D]``.

Two backends here:

* ``"paged-torch"`` (:class:`PagedTorchBackend`, the default): per layer, one gather of the blocks
  the step reads, then :func:`torch.nn.functional.scaled_dot_product_attention` -- a fused kernel on
  the CPU as on a GPU, reading each KV head once for its group of query heads;
* ``"paged-reference"`` (:class:`PagedReferenceBackend`): the plain references of
  :mod:`kvcourse.kernels.reference`, a tile of blocks at a time, one prefill at a time. Slow and
  obviously right: what every other paged backend is tested against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..batch import ForwardBatch
from ..kernels.reference import compute_dtype, paged_attention
from ..paged.kv_store import PagedKVStore
from . import register

__all__ = ["PagedBackend", "PagedReferenceBackend", "PagedTorchBackend"]


class PagedBackend:
    """What every paged backend shares: the store it needs, the split of the step, the layer loop.

    Subclasses implement :meth:`decode` and :meth:`prefill` (and may replace :meth:`write_kv`).
    """

    name = "paged"
    store_type: type = PagedKVStore  # the pool this backend reads and writes

    @classmethod
    def make_store(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> PagedKVStore:
        """A pool of this backend's kind for a model with ``config``."""
        return cls.store_type.for_model(config, num_blocks, block_size, dtype, device)

    def __init__(self, kv_pool, batch: ForwardBatch) -> None:
        self.attach(kv_pool, batch)
        qsl, lens = batch.query_start_loc_host, batch.seq_lens_host
        self.decode_seqs = [b for b in range(batch.num_seqs) if qsl[b + 1] - qsl[b] == 1]
        self.prefill_seqs = [b for b in range(batch.num_seqs) if qsl[b + 1] - qsl[b] > 1]
        self.all_decode = len(self.decode_seqs) == batch.num_seqs
        self.decode_max_len = max((lens[b] for b in self.decode_seqs), default=0)
        if self.all_decode:  # the common serving step: row b is sequence b, the batch's own tensors serve
            self.decode_tables, self.decode_lens = batch.block_tables, batch.seq_lens
            return
        device = batch.input_ids.device
        idx = torch.tensor(self.decode_seqs, dtype=torch.int64, device=device)
        self.decode_rows = batch.query_start_loc[:-1].to(torch.int64)[idx]  # each decode's row in the batch
        self.decode_tables = batch.block_tables[idx]
        self.decode_lens = batch.seq_lens[idx]
        rows = [r for b in self.prefill_seqs for r in range(qsl[b], qsl[b + 1])]
        self.prefill_rows = torch.tensor(rows, dtype=torch.int64, device=device)

    def attach(self, kv_pool, batch: ForwardBatch) -> None:
        """Check the pool and the batch, and keep them (with the softmax scale) for the step's layers."""
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        # The format too: an int8 store is a PagedKVStore subclass, but its blocks hold codes, not floats.
        if not isinstance(kv_pool, self.store_type) or kv_pool.format != self.store_type.format:
            raise TypeError(f"backend {self.name!r} needs a {self.store_type.__name__}, got {type(kv_pool).__name__}")
        self.pool, self.batch = kv_pool, batch
        self.scale = 1.0 / math.sqrt(kv_pool.head_dim)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write_kv(layer_idx, k, v)
        if self.all_decode:
            return self.decode(layer_idx, q)
        out = torch.empty_like(q)
        if self.decode_seqs:
            out[self.decode_rows] = self.decode(layer_idx, q[self.decode_rows])
        out[self.prefill_rows] = self.prefill(layer_idx, q)
        return out

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter the new tokens' K/V into their slots (the batch was checked: no per-layer checks)."""
        k_cache, v_cache = self.pool.k_cache[layer_idx], self.pool.v_cache[layer_idx]
        if k.dtype != k_cache.dtype:  # a pool in another dtype than the model (tests use float64 pools)
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        flat = (-1, *k_cache.shape[2:])  # the pool viewed as one row of slots: the copies land in place
        k_cache.view(flat).index_copy_(0, self.batch.slot_mapping, k)
        v_cache.view(flat).index_copy_(0, self.batch.slot_mapping, v)

    def decode(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """The decoding sequences' queries ``[Bd, Hq, D]`` -> their outputs ``[Bd, Hq, D]``."""
        raise NotImplementedError

    def prefill(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Every query of the step ``[N, Hq, D]`` -> the outputs of the prefill rows, in order."""
        raise NotImplementedError


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the 0 / -inf bias SDPA adds to the scores, in ``dtype``.

    SDPA turns a boolean mask into this itself, on every call: 6 framework calls per layer, 180 a
    step. Made once per step, the conversion is done once; the result is the same, bit for bit.
    """
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


@register("paged-reference")
class PagedReferenceBackend(PagedBackend):
    """The plain torch references, read through the block tables: slow, obviously right."""

    def layer_pool(self, layer_idx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s K and V pools as the reference reads them."""
        return self.pool.k_cache[layer_idx], self.pool.v_cache[layer_idx]

    def decode(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.layer_pool(layer_idx, q.dtype)
        lens = self.decode_lens
        return paged_attention(q[:, None], (lens.to(torch.int64) - 1)[:, None], k_cache, v_cache,
                               self.decode_tables, lens, self.scale, self.decode_max_len)[:, 0]  # fmt: skip

    def prefill(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.layer_pool(layer_idx, q.dtype)
        batch, qsl, outs = self.batch, self.batch.query_start_loc_host, []
        for b in self.prefill_seqs:  # one sequence at a time: the reference favours clarity
            lo, hi = qsl[b], qsl[b + 1]
            outs.append(paged_attention(q[None, lo:hi], batch.positions[None, lo:hi], k_cache, v_cache,
                                        batch.block_tables[b : b + 1], batch.seq_lens[b : b + 1], self.scale,
                                        batch.seq_lens_host[b])[0])  # fmt: skip
        return torch.cat(outs)


@register("paged-torch")
class PagedTorchBackend(PagedBackend):
    """Gather the blocks the step reads, once per layer, and attend with one fused SDPA call per group.

    Per step (the decodes' part on the first layer's :meth:`decode`, so that a backend reusing this class
    with its own decode kernel -- ``"triton"`` -- never builds it): for the decodes, the ``[Bd, M]`` blocks
    of their tables (``M`` blocks hold the longest context) and a key mask for the shorter ones and the
    last block's unused slots; for the prefill rows (here, in ``__init__``), the same ``[Bp, M]`` blocks, the queries padded to ``[Bp, T]`` (``T``
    the longest chunk) and a causal mask built from positions. Per layer: one ``index_select`` of
    whole blocks per K and V -- the only copy, ``block_size`` tokens a row -- then SDPA, which groups
    the query heads of each KV head itself (``enable_gqa``), so K and V are never repeated per head.
    """

    def __init__(self, kv_pool, batch) -> None:
        super().__init__(kv_pool, batch)
        self.decode_blocks = None  # built by the first decode() of the step
        if self.prefill_seqs:
            self._prepare_prefill()

    def _prepare_decode(self, dtype: torch.dtype) -> None:
        d = self.decode_seqs
        self.decode_blocks, key_ok, self.decode_padding = self._blocks(d, self.decode_max_len)
        # Every decode sees its whole context: a mask only if some gathered row is not a key (known on the host).
        whole = all(self.batch.seq_lens_host[b] == key_ok.shape[1] for b in d)
        self.decode_mask = None if whole else additive_mask(key_ok[:, None, None, :], dtype)

    def _blocks(self, seqs: list[int], max_len: int) -> tuple[torch.Tensor, ...]:
        """What a group reads: the blocks holding positions ``0 .. max_len-1`` of ``seqs``, ``[B * M]``;
        which of their ``M * block_size`` rows are keys, ``[B, M * block_size]``; and the gathered
        rows that may hold another sequence's leftovers, to be zeroed (see :meth:`attend`).

        A shorter sequence's table is padded (-1) up to ``M`` columns; the padding reads the sequence's
        own first block, whose rows ``0 .. len-1`` hold its own K/V. So the only rows that can hold
        anything else are past ``len`` in its own last block, or past ``len`` in that repeated first
        block: at most ``block_size`` per sequence, not every padding row. They are listed on the host,
        from the lengths the batch carries there.
        """
        bs, device = self.batch.block_size, self.batch.input_ids.device
        m = -(-max_len // bs)
        tables = self.batch.block_tables[:, :m] if self.all_decode else self.batch.block_tables[seqs, :m]
        tables = tables.to(torch.int64)
        tables = torch.where(tables >= 0, tables, tables[:, :1])  # table padding -> the sequence's first block
        lens = torch.tensor([self.batch.seq_lens_host[b] for b in seqs], device=device)
        key_ok = torch.arange(m * bs, device=device)[None, :] < lens[:, None]
        leftovers = []
        for i, b in enumerate(seqs):
            n, base = self.batch.seq_lens_host[b], i * m * bs
            used = -(-n // bs)
            leftovers += range(base + n, base + used * bs)  # past the end of its own last block
            for j in range(used, m):  # each padding entry repeats block 0: its rows past n
                leftovers += range(base + j * bs + n, base + (j + 1) * bs)
        padding = torch.tensor(leftovers, dtype=torch.int64, device=device)
        return tables.flatten(), key_ok, padding

    def _prepare_prefill(self) -> None:
        batch, qsl = self.batch, self.batch.query_start_loc_host
        device = batch.input_ids.device
        p = torch.tensor(self.prefill_seqs, dtype=torch.int64, device=device)
        q_lens_host = [qsl[b + 1] - qsl[b] for b in self.prefill_seqs]
        q_lens = torch.tensor(q_lens_host, device=device)
        self.prefill_t = max(q_lens_host)
        max_len = max(batch.seq_lens_host[b] for b in self.prefill_seqs)
        self.prefill_blocks, key_ok, self.prefill_padding = self._blocks(self.prefill_seqs, max_len)
        # Queries padded to [Bp, T]: a padding row repeats its sequence's first row (its output is dropped).
        t = torch.arange(self.prefill_t, device=device)
        # Which padded rows are real queries: listed on the host (a boolean mask would cost a read back).
        real = [i * self.prefill_t + j for i, n in enumerate(q_lens_host) for j in range(n)]
        self.prefill_q_ok = torch.tensor(real, dtype=torch.int64, device=device)
        first = batch.query_start_loc[:-1].to(torch.int64)[p]
        self.prefill_q_rows = (first[:, None] + torch.where(t[None, :] < q_lens[:, None], t[None, :], 0)).flatten()
        q_pos = batch.positions[self.prefill_q_rows].view(len(p), self.prefill_t)
        k_pos = torch.arange(key_ok.shape[1], device=device)
        self.prefill_mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & key_ok[:, None, :]  # [Bp, T, S]
        self.prefill_mask = self.prefill_mask[:, None]  # [Bp, 1, T, S]: one mask for every head
        self.prefill_bias = None  # the mask as SDPA adds it, made by the first prefill() (it needs q's dtype)

    def read_kv(self, layer_idx: int, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` from layer ``layer_idx``'s pool, ``[n, block_size, Hkv, D]`` in ``dtype``."""
        k = self.pool.k_cache[layer_idx].index_select(0, blocks)
        v = self.pool.v_cache[layer_idx].index_select(0, blocks)
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))

    @staticmethod
    def compute_dtype(dtype: torch.dtype) -> torch.dtype:
        """The dtype attention runs in for queries of ``dtype`` (float64 pools in the tests: see ``compute_dtype``)."""
        return compute_dtype(dtype) if dtype == torch.float64 else dtype

    def attend(
        self, layer_idx: int, q: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor | None, padding: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, T, Hq, D]`` against the K/V of ``blocks [B * M]`` (M per sequence) -> ``[B, T, Hq, D]``."""
        return self.attend_heads(layer_idx, q.transpose(1, 2), blocks, mask, padding).transpose(1, 2)

    def attend_heads(
        self, layer_idx: int, q: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor | None, padding: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`attend` head-major, as SDPA takes it: ``q [B, Hq, T, D]`` -> ``[B, Hq, T, D]``.

        ``mask``: additive (0 or -inf, see :func:`additive_mask`), or None. ``padding``: gathered rows
        past a sequence's length that may hold another sequence's leftovers (a freed sequence's K/V;
        NaN in the tests). The mask keeps them out of the softmax, but a weight of 0 times NaN is still
        NaN: so they are zeroed in the gathered copy first, as a kernel never loads them.
        """
        b, cdt = q.shape[0], self.compute_dtype(q.dtype)
        k, v = self.read_kv(layer_idx, blocks, cdt)
        if padding.numel():
            k.view(-1, *k.shape[2:]).index_fill_(0, padding, 0.0)
            v.view(-1, *v.shape[2:]).index_fill_(0, padding, 0.0)
        k = k.view(b, -1, *k.shape[2:]).transpose(1, 2)  # [B, Hkv, M * block_size, D], a view
        v = v.view(b, -1, *v.shape[2:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q if q.dtype == cdt else q.to(cdt), k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def decode(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        if self.decode_blocks is None:
            self._prepare_decode(self.compute_dtype(q.dtype))
        # [Bd, Hq, 1, D]: one query per sequence, already head-major for SDPA (no transposes either way).
        out = self.attend_heads(layer_idx, q.unsqueeze(2), self.decode_blocks, self.decode_mask, self.decode_padding)
        return out.view(q.shape)

    def prefill(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        if self.prefill_bias is None:
            self.prefill_bias = additive_mask(self.prefill_mask, self.compute_dtype(q.dtype))
        padded = q[self.prefill_q_rows].view(-1, self.prefill_t, *q.shape[1:])
        out = self.attend(layer_idx, padded, self.prefill_blocks, self.prefill_bias, self.prefill_padding)
        return out.flatten(0, 1)[self.prefill_q_ok]
