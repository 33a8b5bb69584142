"""A Llama-architecture decoder, readable in one sitting.

Embedding -> N x [RMSNorm -> GQA attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual]
-> RMSNorm -> output head. The names follow the Llama paper and Hugging Face's
``modeling_llama.py`` so that weights map one to one.

What makes this a *course* model is where attention goes. Every layer hands its new
tokens' Q, K and V (RoPE applied) to an **attention backend** (:mod:`kvcourse.backends`) and
knows nothing about caches. Two entry points choose the backend:

* ``model(input_ids, cache=None)`` -- chapters 1-2: ``[B, T]`` tokens of equal-length sequences.
  Without a cache the model recomputes the whole sequence (the naive loop); with a contiguous
  :class:`~kvcourse.KVCache` it runs the new tokens only, appends their K/V and attends over the history.
* ``model.forward_batch(batch, kv_pool)`` -- chapter 4 on: one ragged step of many sequences (whole
  prompts, prefill chunks and decode tokens mixed) described by a :class:`~kvcourse.batch.ForwardBatch`,
  its K/V in a paged pool.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .backends import AttentionBackend, ContiguousBackend, KVCacheLike, NoCache, paged_backend
from .batch import ForwardBatch

__all__ = ["LlamaConfig", "LlamaModel", "KVCacheLike", "apply_rope", "rope_cos_sin"]


@dataclass
class LlamaConfig:
    """Model shape, with Hugging Face ``config.json`` names."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_id: list[int] = field(default_factory=lambda: [2])
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def to_dict(self) -> dict:
        """The config as a Hugging Face ``config.json``-style dict."""
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / sqrt(mean(x^2) + eps), in fp32 for stability as the reference implementation does.
        # F.rms_norm is exactly that formula in one fused op (fewer small ops per decode step).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[T, head_dim]`` for the given absolute positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # the "rotate half" layout: pairs are (i, i + D/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by position; ``cos``/``sin`` broadcast against it (``[T, D]`` for ``x [B, H, T, D]``,
    ``[T, 1, D]`` for ``x [B, T, H, D]``). K is rotated *before* it is cached, so it never changes again."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)  # [B, T, H, D]: token-major
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn(self.layer_idx, q, k, v)  # the backend stores K/V (or not) and attends
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """``model(input_ids [B, T], cache=None) -> logits [B, T, vocab]``; ``model.forward_batch(batch, kv_pool)``.

    With a cache holding ``S`` tokens, ``input_ids`` are taken to be positions
    ``S .. S+T-1``; their K and V are appended to the cache in place.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (cos, sin)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCacheLike | None = None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer torch.Tensor [B, T], got {type(input_ids).__name__}")
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        self.check_token_ids(input_ids, "input_ids")
        if cache is not None and not (hasattr(cache, "update") and hasattr(cache, "seq_len")):
            raise TypeError(
                f"cache must be a contiguous cache with seq_len and update() (a kvcourse.KVCache), got "
                f"{type(cache).__name__}; a paged cache runs through model.forward_batch(cache.prepare(ids), cache.kv_store)"
            )
        start = 0 if cache is None else cache.seq_len  # read once, before any layer runs
        self.check_context(start + input_ids.shape[1])
        input_ids = input_ids.to(self.device)  # ids are host data: torch.tensor([ids]) works on a GPU model too
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        attn = NoCache() if cache is None else ContiguousBackend(cache, start)
        return self.lm_head(self.hidden_states(input_ids, positions, attn))

    @torch.inference_mode()
    def forward_batch(
        self, batch: ForwardBatch, kv_pool, backend: str = "paged-torch", all_logits: bool = False
    ) -> torch.Tensor:
        """One ragged step on a paged pool: logits ``[B, vocab]`` at each sequence's last new token.

        ``all_logits=True`` returns ``[N, vocab]``, one row per packed token. The caller has already
        allocated every slot the batch writes (copy-on-write copies included).
        """
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a kvcourse.batch.ForwardBatch, got {type(batch).__name__}")
        if batch.block_size != kv_pool.block_size:
            raise ValueError(f"batch.block_size ({batch.block_size}) must equal kv_pool.block_size ({kv_pool.block_size})")
        if batch.max_block_host >= kv_pool.num_blocks:
            raise ValueError(
                f"batch.block_tables name block {batch.max_block_host}, but kv_pool has {kv_pool.num_blocks} blocks"
            )
        batch.check()  # a batch made by hand is checked here, once; a built one already was
        self.check_context(batch.max_seq_len)
        self.check_token_ids(batch.input_ids, "batch.input_ids")
        batch = batch.to(self.device)
        hidden = self.hidden_states(batch.input_ids[None], batch.positions, paged_backend(backend, kv_pool, batch))[0]
        if not all_logits:
            hidden = hidden[batch.last_token_indices]  # only the rows whose next token we need
        return self.lm_head(hidden)

    def check_token_ids(self, ids: torch.Tensor, name: str) -> None:
        """Raise a clear ValueError if a token id is outside the vocabulary. (The embedding lookup would
        raise a bare IndexError on a CPU, and a device-side assert that ends the process on a GPU.)"""
        lo, hi = torch.aminmax(ids)
        lo, hi = torch.stack((lo, hi)).tolist()  # one read back from the device
        if lo < 0 or hi >= self.config.vocab_size:
            bad = ids[(ids < 0) | (ids >= self.config.vocab_size)].unique()[:5].tolist()
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad}")

    def check_context(self, num_tokens: int) -> None:
        """Raise a clear ValueError if a sequence of ``num_tokens`` does not fit the model's context."""
        if num_tokens > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {num_tokens} tokens exceeds the model's context length "
                f"({self.config.max_position_embeddings} positions)"
            )

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """The decoder stack: ``input_ids [B, T]`` at ``positions [T]`` -> final-norm hidden states ``[B, T, hidden]``."""
        cos, sin = self.rope_tables(positions)
        cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]  # [T, 1, D]: broadcast over heads
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position up to the largest in ``positions``, ``[L, D]``: computed once and
        kept (grown by doubling), so a decode step looks its rows up instead of recomputing them."""
        needed = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self._rope_tables.get(positions.device, (None, None))
        if cos is None or cos.shape[0] < needed:
            length = min(max(needed, 2 * (0 if cos is None else cos.shape[0]), 256), self.config.max_position_embeddings)
            table = torch.arange(length, device=positions.device)
            cos, sin = rope_cos_sin(table, self.config.head_dim, self.config.rope_theta)
            self._rope_tables[positions.device] = (cos, sin)
        return cos, sin

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads={c.num_attention_heads}, "
            f"kv_heads={c.num_key_value_heads}, head_dim={c.head_dim}, rope_theta={c.rope_theta:g}, "
            f"params={self.num_parameters() / 1e6:.1f}M"
        )

