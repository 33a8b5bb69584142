"""Caching less per token by changing attention itself: GQA, MQA and multi-head latent attention (MLA).

Values cached per token per layer, with ``n_h`` query heads of size ``d_h``:

    MHA  2 * n_h * d_h          every head has its own K and V
    GQA  2 * n_g * d_h          ``n_g`` groups of heads share one K and V (SmolLM2: 3 for 9 heads)
    MQA  2 * d_h                all heads share one K and V
    MLA  d_c + d_rope           one latent vector, expanded to every head's K and V when needed

**MLA** (DeepSeek-V2, 2024; DeepSeek-V3) caches a *latent* ``c = x W_dkv`` of ``d_c`` values per token
(512 in DeepSeek-V3) and a small RoPE key ``k_rope`` shared by all heads (64 values). Keys and values
are linear in the latent, ``k_h = c W_uk[h]`` and ``v_h = c W_uv[h]``. So attention can either

* **expand**: rebuild every head's K and V from the cached latents, then attend as usual; or
* **absorb**: fold ``W_uk`` into the query (``q_h W_uk[h]^T`` lives in latent space), attend over the
  latents directly, and fold ``W_uv`` into the output. Nothing per head is ever materialised for the
  cached tokens: decode reads ``d_c + d_rope`` values per token, the size of the cache.

RoPE cannot be absorbed (it depends on the key's position), hence the separate ``k_rope``.
:class:`MultiHeadLatentAttention` is a small, randomly initialised MLA layer that computes both forms;
the tests check they equal plain attention over the expanded K and V. The memory math for real
models is :mod:`kvcourse.memory`'s (DeepSeek-V3 is in its catalog).

:func:`pooled_kv_heads` turns a GQA model into one with fewer KV heads by averaging each group's K and V
projections (how Ainslie et al., *GQA*, EMNLP 2023, start converting a model, before retraining it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .checks import check_int
from .model import apply_rope, rope_cos_sin

__all__ = ["LatentCache", "MLAConfig", "MultiHeadLatentAttention", "kv_values_per_token", "pooled_kv_heads"]


def kv_values_per_token(
    kind: str, num_heads: int, head_dim: int, num_groups: int = 1, kv_lora_rank: int = 0, rope_dim: int = 0
) -> int:
    """Values cached per token per layer for ``kind`` in ``"MHA"``, ``"GQA"``, ``"MQA"``, ``"MLA"``."""
    if kind == "MHA":
        return 2 * num_heads * head_dim
    if kind == "GQA":
        return 2 * num_groups * head_dim
    if kind == "MQA":
        return 2 * head_dim
    if kind == "MLA":
        return kv_lora_rank + rope_dim
    raise ValueError(f"kind must be 'MHA', 'GQA', 'MQA' or 'MLA', got {kind!r}")


@dataclass(frozen=True)
class MLAConfig:
    """An MLA layer's shape; names as in DeepSeek-V3's ``config.json`` (there 7168, 128, 128, 64, 128, 512)."""

    hidden_size: int = 256
    num_heads: int = 4
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    kv_lora_rank: int = 64
    rope_theta: float = 10000.0


class LatentCache:
    """What MLA caches: one latent ``[B, S, kv_lora_rank]`` and one shared RoPE key ``[B, S, rope]`` per token."""

    def __init__(self) -> None:
        self.latent: torch.Tensor | None = None
        self.k_rope: torch.Tensor | None = None

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.latent is None:
            self.latent, self.k_rope = latent, k_rope
        else:
            self.latent, self.k_rope = torch.cat([self.latent, latent], 1), torch.cat([self.k_rope, k_rope], 1)
        return self.latent, self.k_rope

    @property
    def seq_len(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    @property
    def nbytes(self) -> int:
        if self.latent is None:
            return 0
        return self.latent.numel() * self.latent.element_size() + self.k_rope.numel() * self.k_rope.element_size()


class MultiHeadLatentAttention(nn.Module):
    """One MLA layer (no query compression, no latent norm: the parts that change what is cached).

    ``forward(x, cache, absorb)``: ``x [B, T, hidden]`` are new tokens after the ``cache.seq_len``
    cached ones; their latents are appended to ``cache``. ``absorb=False`` expands K and V per head,
    ``absorb=True`` attends in latent space; both give the same output. The random weights (from ``seed``)
    are the same on every ``device``.
    """

    def __init__(self, config: MLAConfig, seed: int = 0, device: torch.device | str = "cpu") -> None:
        super().__init__()
        c = self.config = config
        h = c.num_heads

        def linear(n_in: int, n_out: int) -> nn.Linear:
            return nn.Linear(n_in, n_out, bias=False, device=device)

        self.q_proj = linear(c.hidden_size, h * (c.qk_nope_head_dim + c.qk_rope_head_dim))
        self.kv_down = linear(c.hidden_size, c.kv_lora_rank)  # W_dkv: x -> latent
        self.k_rope_proj = linear(c.hidden_size, c.qk_rope_head_dim)  # one RoPE key for all heads
        self.k_up = linear(c.kv_lora_rank, h * c.qk_nope_head_dim)  # W_uk: latent -> keys
        self.v_up = linear(c.kv_lora_rank, h * c.v_head_dim)  # W_uv: latent -> values
        self.o_proj = linear(h * c.v_head_dim, c.hidden_size)
        gen = torch.Generator(device="cpu").manual_seed(seed)  # drawn on the host: the same weights on every machine
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, device="cpu") / math.sqrt(p.shape[1]))
        self.scale = 1.0 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(positions, self.config.qk_rope_head_dim, self.config.rope_theta)
        return apply_rope(x, cos if x.ndim == 3 else cos[:, None], sin if x.ndim == 3 else sin[:, None])

    @torch.no_grad()
    def forward(self, x: torch.Tensor, cache: LatentCache, absorb: bool = False) -> torch.Tensor:
        c = self.config
        b, t, _ = x.shape
        start = cache.seq_len
        positions = torch.arange(start, start + t, device=x.device)
        q = self.q_proj(x).view(b, t, c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
        q_rope = self._rope(q_rope, positions)  # [B, T, H, rope]
        latent, k_rope = cache.update(self.kv_down(x), self._rope(self.k_rope_proj(x), positions))  # [B, S, .]
        s = latent.shape[1]
        future = torch.arange(s, device=x.device)[None, :] > positions[:, None]  # [T, S]
        rope_scores = torch.einsum("bthr,bsr->bhts", q_rope, k_rope)
        w_uk = self.k_up.weight.view(c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank)
        w_uv = self.v_up.weight.view(c.num_heads, c.v_head_dim, c.kv_lora_rank)
        if absorb:
            q_latent = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # the query moved into latent space
            scores = torch.einsum("bthc,bsc->bhts", q_latent, latent) + rope_scores
            probs = torch.softmax((scores * self.scale).masked_fill(future, float("-inf")), -1)
            context = torch.einsum("bhts,bsc->bthc", probs, latent)  # still in latent space
            out = torch.einsum("bthc,hvc->bthv", context, w_uv)
        else:
            k_nope = torch.einsum("bsc,hnc->bshn", latent, w_uk)  # every head's keys, rebuilt
            v = torch.einsum("bsc,hvc->bshv", latent, w_uv)
            scores = torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + rope_scores
            probs = torch.softmax((scores * self.scale).masked_fill(future, float("-inf")), -1)
            out = torch.einsum("bhts,bshv->bthv", probs, v)
        return self.o_proj(out.reshape(b, t, c.num_heads * c.v_head_dim))

    def expanded_kv(self, cache: LatentCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-head K ``[B, H, S, nope + rope]`` and V ``[B, H, S, v]`` the latents stand for
        (what an MHA cache of the same layer would hold)."""
        c = self.config
        b, s, _ = cache.latent.shape
        k_nope = self.k_up(cache.latent).view(b, s, c.num_heads, c.qk_nope_head_dim)
        k_rope = cache.k_rope[:, :, None].expand(b, s, c.num_heads, c.qk_rope_head_dim)
        v = self.v_up(cache.latent).view(b, s, c.num_heads, c.v_head_dim)
        return torch.cat([k_nope, k_rope], -1).transpose(1, 2), v.transpose(1, 2)


@contextmanager
def pooled_kv_heads(model, num_kv_heads: int) -> Iterator[None]:
    """Within the block, ``model`` has ``num_kv_heads`` KV heads: each group of its K and V projections
    replaced by the group's mean (GQA's conversion, without the retraining). Restored on exit."""
    config = model.config
    old = config.num_key_value_heads
    check_int("num_kv_heads", num_kv_heads, min=1)
    if old % num_kv_heads:
        raise ValueError(f"num_kv_heads must divide the model's {old} KV heads, got {num_kv_heads!r}")
    saved = []
    for layer in model.layers:
        attn = layer.self_attn
        saved.append(attn.qkv_proj.weight)
        pooled = [proj.weight.detach().view(num_kv_heads, old // num_kv_heads, config.head_dim, -1).mean(1)
                  .reshape(num_kv_heads * config.head_dim, -1) for proj in (attn.k_proj, attn.v_proj)]  # fmt: skip
        # The packed projection gets fewer K and V rows: [Q | pooled K | pooled V].
        packed = torch.cat([attn.q_proj.weight.detach(), *pooled])
        attn.qkv_proj.weight = nn.Parameter(packed, requires_grad=False)
        attn.n_kv_heads = num_kv_heads
    config.num_key_value_heads = num_kv_heads
    try:
        yield
    finally:
        for layer, weight in zip(model.layers, saved):
            layer.self_attn.qkv_proj.weight = weight
            layer.self_attn.n_kv_heads = old
        config.num_key_value_heads = old
