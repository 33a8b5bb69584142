"""Paged K/V memory: slot mapping, the block pool, and paged attention in plain torch.

Per layer the pool is one K and one V tensor of shape ``[num_blocks, block_size, H_kv, D]``
(vLLM's layout, token-major inside a block). Viewed flat it is ``num_blocks * block_size``
token **slots**; the **slot mapping** turns a token's position in its sequence into a slot:

    slot = block_table[pos // block_size] * block_size + pos % block_size

Writing new tokens is a scatter into their slots; reading a sequence back is a gather
through its block table. :func:`paged_attention_ref` does decode attention straight from
the pool: it is the reference that chapter 5's Triton kernel is tested against, so it
checks its inputs strictly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["PagedKVStore", "paged_attention_ref", "slot_mapping"]


def slot_mapping(
    block_table: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor, block_size: int
) -> torch.Tensor:
    """Physical slots (int64 ``[T]``) of token ``positions`` of a sequence with ``block_table``."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    table = torch.as_tensor(block_table, dtype=torch.int64)
    pos = torch.as_tensor(positions, dtype=torch.int64, device=table.device)
    if table.ndim != 1 or pos.ndim != 1:
        raise ValueError(f"block_table and positions must be 1-D, got {tuple(table.shape)} and {tuple(pos.shape)}")
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= table.numel() * block_size):
        raise ValueError(
            f"positions must lie in [0, {table.numel() * block_size}) for a table of {table.numel()} blocks "
            f"of {block_size}, got [{int(pos.min())}, {int(pos.max())}]"
        )
    return table[pos // block_size] * block_size + pos % block_size


class PagedKVStore:
    """The block pool: per layer, ``k_cache[layer]`` and ``v_cache[layer]`` of ``[num_blocks, block_size, H_kv, D]``.

    It knows nothing about sequences; a :class:`~kvcourse.paged.BlockManager` decides which
    slots each sequence uses.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros rather than empty: a bug that reads an unwritten slot then gives a visible
        # wrong answer in tests instead of whatever bytes were in memory.
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_cache[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k_cache[0].device

    @property
    def block_nbytes(self) -> int:
        """Bytes one block holds across all layers, K and V: 2 x layers x block_size x H_kv x D x itemsize."""
        return 2 * self.num_layers * self.k_cache[0][0].nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (allocated up front, as vLLM does at start-up)."""
        return self.num_blocks * self.block_nbytes

    def _check_layer(self, layer_idx: int) -> None:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be an int in [0, {self.num_layers}), got {layer_idx!r}")

    def write(self, layer_idx: int, slots: torch.Tensor | Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter new tokens' ``k, v [T, H_kv, D]`` into ``slots [T]`` of layer ``layer_idx``."""
        self._check_layer(layer_idx)
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        expected = (slots.numel(), self.num_kv_heads, self.head_dim)
        if slots.ndim != 1:
            raise ValueError(f"slots must be 1-D [T], got shape {tuple(slots.shape)}")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor [T, H_kv, D], got {type(t).__name__}")
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape [T, H_kv, D] = {list(expected)}, got {list(t.shape)}")
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_blocks * self.block_size):
            raise ValueError(f"slots must lie in [0, {self.num_blocks * self.block_size}), got {slots.tolist()}")
        flat = (-1, self.num_kv_heads, self.head_dim)  # views of the pool: writes land in place
        self.k_cache[layer_idx].view(flat)[slots] = k.to(self.dtype)
        self.v_cache[layer_idx].view(flat)[slots] = v.to(self.dtype)

    def gather(
        self, layer_idx: int, block_table: Sequence[int] | torch.Tensor, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first ``seq_len`` tokens of layer ``layer_idx`` as contiguous ``k, v [H_kv, S, D]``."""
        self._check_layer(layer_idx)
        if not isinstance(seq_len, int) or seq_len < 0:
            raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}")
        table = torch.as_tensor(block_table, dtype=torch.int64, device=self.device)
        if table.numel() and (int(table.min()) < 0 or int(table.max()) >= self.num_blocks):
            raise ValueError(f"block_table entries must lie in [0, {self.num_blocks}), got {table.tolist()}")
        slots = slot_mapping(table, torch.arange(seq_len, device=self.device), self.block_size)
        flat = (-1, self.num_kv_heads, self.head_dim)
        k = self.k_cache[layer_idx].view(flat)[slots].transpose(0, 1)  # [S, H, D] -> [H, S, D]
        v = self.v_cache[layer_idx].view(flat)[slots].transpose(0, 1)
        return k, v

    def copy_block(self, src_block: int, dst_block: int) -> None:
        """Copy-on-write: duplicate block ``src_block``'s K/V into ``dst_block`` in every layer."""
        for name, b in (("src_block", src_block), ("dst_block", dst_block)):
            if not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise ValueError(f"{name} must be an int in [0, {self.num_blocks}), got {b!r}")
        for k_cache, v_cache in zip(self.k_cache, self.v_cache):
            k_cache[dst_block] = k_cache[src_block]
            v_cache[dst_block] = v_cache[src_block]

    def __repr__(self) -> str:
        return (
            f"PagedKVStore(layers={self.num_layers}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, nbytes={self.nbytes:,})"
        )


def _check_int32(name: str, t: object, ndim: int, shape_doc: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor {shape_doc}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 {shape_doc} (use .to(torch.int32)), got {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim} {shape_doc}, got shape {tuple(t.shape)}")
    return t


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention read through block tables: ``q [B, Hq, D]`` -> ``[B, Hq, D]``.

    Args:
        q: one query per sequence, ``[B, Hq, D]``.
        k_cache, v_cache: one layer's pool, ``[num_blocks, block_size, Hkv, D]``; ``Hq % Hkv == 0``.
        block_tables: int32 ``[B, max_blocks]``; row ``b``'s first ``ceil(seq_lens[b] / block_size)``
            entries are sequence ``b``'s blocks, the rest is padding (any value, never read).
        seq_lens: int32 ``[B]``, tokens cached per sequence, each in ``[1, max_blocks * block_size]``.
        scale: softmax scale, default ``1 / sqrt(D)``.

    Equal to :func:`kvcourse.attention.decode_attention_ref` on the gathered, contiguous K/V.
    """
    pool_doc = "[num_blocks, block_size, Hkv, D]"
    for name, t, doc in (("q", q, "[B, Hq, D]"), ("k_cache", k_cache, pool_doc), ("v_cache", v_cache, pool_doc)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {doc}, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.ndim != len(doc.split(",")):
            raise ValueError(f"{name} must have rank {len(doc.split(','))} {doc}, got shape {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} is {t.dtype} on {t.device} but q is {q.dtype} on {q.device}; they must match")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, hq, head_dim = q.shape
    num_blocks, block_size, hkv, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"k_cache has head_dim {cache_dim} but q has {head_dim}")
    if hq % hkv:
        raise ValueError(f"the number of query heads in q ({hq}) must be a multiple of the KV heads in k_cache ({hkv})")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    _check_int32("block_tables", block_tables, 2, "[B, max_blocks]")
    _check_int32("seq_lens", seq_lens, 1, "[B]")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on one device")
        if t.shape[0] != batch:
            raise ValueError(f"{name} has {t.shape[0]} rows but q has batch size {batch}")
    max_blocks = block_tables.shape[1]
    lens = seq_lens.long()
    if bool((lens < 1).any()) or bool((lens > max_blocks * block_size).any()):
        raise ValueError(
            f"seq_lens must lie in [1, max_blocks * block_size] = [1, {max_blocks * block_size}], got {lens.tolist()}"
        )
    s = max_blocks * block_size
    pos = torch.arange(s, device=q.device)
    valid = pos[None, :] < lens[:, None]  # [B, S]: which positions hold real tokens
    used_blocks = (torch.arange(max_blocks, device=q.device)[None, :] * block_size) < lens[:, None]
    tables = block_tables.long()
    bad = used_blocks & ((tables < 0) | (tables >= num_blocks))
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0])
        raise ValueError(
            f"block_tables[{row}] points outside [0, {num_blocks}) in its used entries: {tables[row].tolist()}"
        )

    # Gather every sequence's tokens through its block table. Padding entries are replaced by
    # block 0 so the gather stays in bounds; the mask below makes sure they are never attended to.
    tables = torch.where(used_blocks, tables, torch.zeros_like(tables))
    slots = tables[:, pos // block_size] * block_size + pos % block_size  # [B, S]
    k = k_cache.reshape(-1, hkv, head_dim)[slots]  # [B, S, Hkv, D]
    v = v_cache.reshape(-1, hkv, head_dim)[slots]
    # Slots past seq_len hold stale or unwritten data; zero V there so even NaN garbage
    # cannot leak in through 0 * NaN (a kernel simply never loads them).
    v = v.masked_fill(~valid[:, :, None, None], 0.0)

    # GQA without copying K/V: group the query heads that share KV head g, q -> [B, Hkv, G, D].
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    qg = q.reshape(batch, hkv, hq // hkv, head_dim)
    scores = torch.einsum("bgqd,bsgd->bgqs", qg.float(), k.float()) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bgqs,bsgd->bgqd", probs, v.float())
    return out.reshape(batch, hq, head_dim).to(q.dtype)
