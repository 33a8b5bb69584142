"""A sliding-window KV cache as a ring buffer, with attention sinks (StreamingLLM).

A window cache keeps the last ``window`` tokens: memory is bounded whatever the length of the text.
It is a **ring buffer**: the token at position ``p`` goes to slot ``(p - num_sinks) % window``,
overwriting the token ``window`` positions before it, so nothing is ever shifted or copied.

Xiao et al., *Efficient Streaming Language Models with Attention Sinks* (ICLR 2024), observed that
dropping the very first tokens wrecks a model even though their text hardly matters: softmax must
put its weight somewhere, and models learn to dump it on the first tokens (the **attention sinks**).
Keeping ``num_sinks`` first tokens for good, next to the window, restores the quality.

The cache returns keys in slot order, not in position order; :meth:`SinkKVCache.key_positions`
tells attention where each one sits, and the causal mask is built from those positions. A forward
of ``T`` new tokens reads the held tokens plus the new ones; the cache keeps at most
``num_sinks + window`` of them afterwards. Decoding one token at a time (``T = 1``), every query
sees exactly the sinks and the last ``window`` tokens before it, as StreamingLLM does.

RoPE is applied before caching, so kept tokens keep their original positions (StreamingLLM
re-numbers positions inside the cache to run past the training context; we stay within it).

Decoding a long text one token at a time is slow on a CPU. :func:`simulate_window_logits` gets the
same logits in one forward pass, by masking each query to exactly what the cache would hold
(:func:`window_mask`); a test checks the two agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import check_update
from ..checks import check_float_dtype, check_int, check_ints
from ..kernels.reference import repeat_kv
from ..utils import check_config

__all__ = ["SinkKVCache", "WindowSimulation", "ring_slot", "simulate_window_logits", "window_mask"]


def ring_slot(pos: int | torch.Tensor, num_sinks: int, window: int) -> int | torch.Tensor:
    """The slot (of ``num_sinks + window``) that holds the token at position ``pos`` (an int or a tensor)."""
    if isinstance(pos, torch.Tensor):
        return torch.where(pos < num_sinks, pos, num_sinks + (pos - num_sinks) % window)
    return pos if pos < num_sinks else num_sinks + (pos - num_sinks) % window


class _Layer:
    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [B, H, num_sinks + window, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = torch.full((shape[2],), -1, dtype=torch.int64, device=device)  # -1: slot never written
        self.length = 0  # tokens seen
        self.returned_pos: torch.Tensor | None = None  # positions of the keys the last update returned


class SinkKVCache:
    """Per-layer K/V of the first ``num_sinks`` tokens and a ring buffer of the last ``window``.

    ``seq_len`` is the number of tokens seen (the next token's position), not the number held;
    ``num_held`` and ``nbytes`` say what is held. ``num_sinks=0`` is a plain sliding window.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        window: int,
        num_sinks: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        check_ints(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   window=window)  # fmt: skip
        check_int("num_sinks", num_sinks, min=0)
        check_float_dtype("dtype", dtype)
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.window, self.num_sinks, self.dtype = window, num_sinks, dtype
        shape = (batch_size, num_kv_heads, num_sinks + window, head_dim)
        self._layers = [_Layer(shape, dtype, torch.device(device)) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, config, window: int, num_sinks: int = 0, batch_size: int = 1,
                  dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> SinkKVCache:  # fmt: skip
        """A cache shaped for ``config`` (``model.config``)."""
        check_config(config)
        return cls(config.num_hidden_layers, batch_size, config.num_key_value_heads, config.head_dim, window,
                   num_sinks, torch.float32 if dtype is None else dtype, "cpu" if device is None else device)  # fmt: skip

    # ---- what the model calls -------------------------------------------------
    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the held K/V plus ``k, v [B, H_kv, T, D]``; then keep the sinks and the last ``window``."""
        check_update(self, layer_idx, k, v)
        layer = self._layers[layer_idx]
        t = k.shape[2]
        new_pos = torch.arange(layer.length, layer.length + t, device=layer.pos.device)
        held = layer.pos >= 0
        k_out = torch.cat([layer.k[:, :, held], k.to(self.dtype)], 2)
        v_out = torch.cat([layer.v[:, :, held], v.to(self.dtype)], 2)
        layer.returned_pos = torch.cat([layer.pos[held], new_pos])
        # Write the new tokens into their slots. Of a chunk longer than the ring, only the tokens
        # that survive it are written (the others would be overwritten within this same call).
        keep = (new_pos < self.num_sinks) | (torch.arange(t, device=new_pos.device) >= t - self.window)
        slots = self.slots(new_pos[keep])
        layer.k[:, :, slots] = k[:, :, keep].to(self.dtype)
        layer.v[:, :, slots] = v[:, :, keep].to(self.dtype)
        layer.pos[slots] = new_pos[keep]
        layer.length += t
        return k_out.to(k.dtype), v_out.to(v.dtype)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The slots tokens at ``positions`` are written to (:func:`ring_slot`)."""
        return ring_slot(positions, self.num_sinks, self.window)

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """Positions ``[S]`` of the keys the last ``update(layer_idx, ...)`` returned, in the order returned."""
        pos = self._layers[layer_idx].returned_pos
        if pos is None:
            raise ValueError(f"layer {layer_idx} has not been updated yet")
        return pos

    # ---- what readers look at -------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens seen so far: the position of the next token (not how many are held)."""
        return self._layers[0].length

    @property
    def num_held(self) -> int:
        """Tokens held per sequence: at most ``num_sinks + window``."""
        return int((self._layers[0].pos >= 0).sum())

    def held_positions(self, layer_idx: int = 0) -> list[int]:
        """The positions held, slot by slot (-1 for a slot not written yet)."""
        return self._layers[layer_idx].pos.tolist()

    @property
    def nbytes(self) -> int:
        """Bytes of K and V held: 2 x layers x B x H_kv x num_held x D x itemsize (bounded)."""
        per_token = 2 * self.num_layers * self.batch_size * self.num_kv_heads * self.head_dim
        return per_token * self.num_held * self._layers[0].k.element_size()

    def __len__(self) -> int:
        return self.seq_len

    def __repr__(self) -> str:
        return (
            f"SinkKVCache(num_sinks={self.num_sinks}, window={self.window}, layers={self.num_layers}, "
            f"batch={self.batch_size}, seq_len={self.seq_len}, held={self.num_held}, nbytes={self.nbytes:,})"
        )


# ---------------------------------------------------------------------------------------------
# The same attention in one forward pass, for measuring long texts quickly
# ---------------------------------------------------------------------------------------------
def window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int, num_sinks: int = 0) -> torch.Tensor:
    """Bool ``[T, S]``: what a query sees when decoding through a ``SinkKVCache``: itself, the ``window``
    tokens before it, and the first ``num_sinks`` tokens."""
    diff = q_positions[:, None] - k_positions[None, :]
    return (diff >= 0) & ((diff <= window) | (k_positions[None, :] < num_sinks))


class WindowSimulation:
    """An attention backend without a cache: the whole text in one forward, masked by :func:`window_mask`."""

    def __init__(self, window: int, num_sinks: int = 0) -> None:
        self.window, self.num_sinks = window, num_sinks

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
        pos = torch.arange(q.shape[2], device=q.device)
        mask = window_mask(pos, pos, self.window, self.num_sinks)
        n_rep = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask)
        return out.transpose(1, 2)


@torch.inference_mode()
def simulate_window_logits(model, ids, window: int, num_sinks: int = 0) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` (float32) equal to decoding ``ids`` through ``SinkKVCache(window, num_sinks)``."""
    x = torch.tensor([list(ids)], device=model.device)
    positions = torch.arange(x.shape[1], device=model.device)
    hidden = model.hidden_states(x, positions, WindowSimulation(window, num_sinks))
    return model.lm_head(hidden)[0].float()
