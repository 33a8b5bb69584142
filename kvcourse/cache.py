"""The contiguous KV cache: one K and one V tensor per layer, ``[B, H_kv, S, D]``.

The model talks to a cache through one method, :meth:`KVCache.update`: a layer
hands over the K and V of its new tokens and gets back K and V for the whole
sequence so far. Everything else (how memory is laid out, when it grows) is the
cache's business. Chapter 4's paged cache implements the same method over blocks.

Storage grows by doubling, so appending one token is amortised O(1) copies
instead of the O(S) a ``torch.cat`` per step costs (what Hugging Face's
``DynamicCache`` does). ``max_seq_len`` is a hard limit: writing past it raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_float_dtype, check_int, check_ints
from .utils import check_config

__all__ = ["KVCache", "CacheOverflowError", "check_update"]


class CacheOverflowError(ValueError):
    """Raised when a write would take a cache past its declared ``max_seq_len``."""


@dataclass
class _Layer:
    k: torch.Tensor  # [B, H_kv, capacity, D]; only the first `length` positions are live
    v: torch.Tensor
    length: int = 0


def check_update(cache, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """The argument check every cache's ``update`` makes: a layer it has, and ``k, v`` of shape
    ``[B, H_kv, T, D]`` matching its batch size, KV heads and head dim (chapter 8's caches share it)."""
    check_int("layer_idx", layer_idx, min=0, max=cache.num_layers - 1)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point torch.Tensor [B, H_kv, T, D], got "
                f"{getattr(t, 'dtype', type(t).__name__)}"
            )
        if t.ndim != 4:
            raise ValueError(f"{name} must have shape [B, H_kv, T, D], got {list(t.shape)}")
    expected = (cache.batch_size, cache.num_kv_heads, k.shape[2], cache.head_dim)
    if k.shape != expected or v.shape != expected:
        raise ValueError(
            f"k and v must have shape [B, H_kv, T, D] = {list(expected)}, got {list(k.shape)} and {list(v.shape)}"
        )


class KVCache:
    """Per-layer contiguous K/V storage for a batch of ``batch_size`` sequences of equal length.

    Args:
        num_layers: decoder layers (one K and one V tensor each).
        batch_size: sequences in the batch.
        num_kv_heads: KV heads per layer (``H_kv``; fewer than query heads under GQA).
        head_dim: size of each head (``D``).
        max_seq_len: the most tokens the cache may hold; ``None`` for no limit.
        dtype, device: of the stored tensors.
        initial_capacity: positions allocated up front (grows by doubling).

    ``writes`` lists how many tokens each forward pass appended, in order (read off layer 0): ``[5, 1, 1]``
    is a 5-token prefill and two decode steps; ``[3, 3, 2]``, an 8-token prompt prefilled in chunks of 3.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        initial_capacity: int = 64,
    ) -> None:
        check_ints(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   initial_capacity=initial_capacity)  # fmt: skip
        check_int("max_seq_len", max_seq_len, min=1, none_ok=True)
        check_float_dtype("dtype", dtype)
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.max_seq_len, self.dtype, self.device = max_seq_len, dtype, torch.device(device)
        cap = initial_capacity if max_seq_len is None else min(initial_capacity, max_seq_len)
        self._layers = [_Layer(self._empty(cap), self._empty(cap)) for _ in range(num_layers)]
        self.writes: list[int] = []

    @classmethod
    def for_model(
        cls,
        config,
        batch_size: int = 1,
        max_seq_len: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A cache shaped for ``config`` (a :class:`kvcourse.model.LlamaConfig`).

        ``max_seq_len`` defaults to the model's context length
        (``config.max_position_embeddings``); memory is still allocated lazily.
        """
        check_config(config)
        return cls(
            num_layers=config.num_hidden_layers,
            batch_size=batch_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            max_seq_len=config.max_position_embeddings if max_seq_len is None else max_seq_len,
            dtype=torch.float32 if dtype is None else dtype,
            device="cpu" if device is None else device,
        )

    def _empty(self, capacity: int) -> torch.Tensor:
        shape = (self.batch_size, self.num_kv_heads, capacity, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    # ---- what the model calls -------------------------------------------------
    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v [B, H_kv, T, D]`` to layer ``layer_idx``; return that layer's K, V so far."""
        check_update(self, layer_idx, k, v)
        if k.dtype != self.dtype or v.dtype != self.dtype:  # storing would round them without a word
            raise TypeError(f"k and v must be {self.dtype}, the cache's dtype, got {k.dtype} and {v.dtype}")
        layer = self._layers[layer_idx]
        new_len = layer.length + k.shape[2]
        if self.max_seq_len is not None and new_len > self.max_seq_len:
            raise CacheOverflowError(
                f"KV cache overflow: layer {layer_idx} holds {layer.length} tokens and {k.shape[2]} more would "
                f"exceed max_seq_len={self.max_seq_len}"
            )
        if new_len > layer.k.shape[2]:
            self._grow(layer, new_len)
        layer.k[:, :, layer.length : new_len] = k
        layer.v[:, :, layer.length : new_len] = v
        layer.length = new_len
        if layer_idx == 0:  # one entry per forward pass, not per layer
            self.writes.append(k.shape[2])
        return layer.k[:, :, :new_len], layer.v[:, :, :new_len]

    def _grow(self, layer: _Layer, needed: int) -> None:
        capacity = layer.k.shape[2]
        while capacity < needed:
            capacity *= 2
        if self.max_seq_len is not None:
            capacity = min(capacity, self.max_seq_len)
        k, v = self._empty(capacity), self._empty(capacity)
        k[:, :, : layer.length] = layer.k[:, :, : layer.length]
        v[:, :, : layer.length] = layer.v[:, :, : layer.length]
        layer.k, layer.v = k, v

    # ---- what readers look at -------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens cached per sequence (the same in every layer between forward passes)."""
        return self._layers[0].length

    def keys(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s live keys, ``[B, H_kv, seq_len, D]`` (a view, not a copy)."""
        layer = self._layers[layer_idx]
        return layer.k[:, :, : layer.length]

    def values(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s live values, ``[B, H_kv, seq_len, D]`` (a view, not a copy)."""
        layer = self._layers[layer_idx]
        return layer.v[:, :, : layer.length]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V held for the cached tokens: 2 x layers x B x H_kv x seq_len x D x itemsize."""
        return sum(2 * self.keys(i).numel() * self.keys(i).element_size() for i in range(self.num_layers))

    @property
    def allocated_nbytes(self) -> int:
        """Bytes actually allocated, including the spare capacity from doubling."""
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self._layers)

    def crop(self, seq_len: int) -> None:
        """Forget every token from position ``seq_len`` on (keeps the memory)."""
        if not 0 <= seq_len <= self.seq_len:
            raise ValueError(f"seq_len must be in [0, {self.seq_len}], got {seq_len}")
        for layer in self._layers:
            layer.length = seq_len

    def __len__(self) -> int:
        return self.seq_len

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, seq_len={self.seq_len}, max_seq_len={self.max_seq_len}, "
            f"dtype={self.dtype}, nbytes={self.nbytes:,})"
        )
