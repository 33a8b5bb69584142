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
  its K/V in a paged pool. The step's tokens are packed in one row: hidden states ``[N, hidden]``.

**Built like a serving model** (chapter 9, "where a step goes"). A decode step of a small model is
hundreds of tiny operations, and on a GPU each is a kernel launch, so the layer does what vLLM's Llama
does: Q, K and V come out of one packed matmul (``qkv_proj``), gate and up out of another
(``gate_up_proj``), and the norms, RoPE and SiLU-and-mul are one call each (:mod:`kvcourse.kernels.fused`;
Triton kernels on a GPU). The textbook names still work: ``attn.k_proj`` is a view of the K rows of the
packed weight, usable as the ``nn.Linear`` it replaced, so chapters 1-2 can call ``k_proj(x)``. Hugging
Face checkpoints load through :func:`pack_state_dict`. The residual travels beside the hidden state
(``layer(x, residual) -> (x, residual)``) so that each residual add is fused into the norm after it. A backend
that says ``applies_rope`` (the ``"triton"`` backend on a step of one-token sequences) takes the unrotated QKV
and the whole RoPE tables instead, and rotates, stores and attends in one kernel: 8 launches a layer, not 11.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .backends import AttentionBackend, ContiguousBackend, KVCacheLike, NoCache, backend_class
from .batch import ForwardBatch
from .kernels.fused import add_rms_norm, embed_rms_norm, rms_norm, rope, rope_tables_signed, silu_and_mul

__all__ = [
    "KVCacheLike",
    "Linear",
    "LlamaConfig",
    "LlamaModel",
    "PackedRows",
    "apply_rope",
    "pack_state_dict",
    "rope_cos_sin",
]


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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``weight * x / sqrt(mean(x^2) + eps)`` (statistics in fp32, as the reference implementation does).

        With ``residual``: the add before the norm, fused into it; returns ``(normed, x + residual)``.
        """
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


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


class Linear(nn.Linear):
    """``nn.Linear`` without a bias, with one shortcut for the serving step's 2-D rows.

    ``F.linear`` on a CPU is 8 framework calls (it transposes the weight, then dispatches a matmul, which
    dispatches ``mm``); ``torch.mm`` on the weight's transposed view is the same product, bit for bit, in 6.
    A decode step does 121 of them.
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # [N, in]: the packed rows of a serving step
            return torch.mm(x, self.weight.mT)
        return F.linear(x, self.weight)


class PackedRows:
    """Rows ``start:stop`` of a packed projection, used like the ``nn.Linear`` they were packed from.

    ``weight`` is a view of the packed weight (no copy), so ``attn.k_proj(x)`` computes exactly K.
    """

    def __init__(self, packed: Linear, start: int, stop: int) -> None:
        self.packed, self.start, self.stop = packed, start, stop

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.weight[self.start : self.stop]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def __repr__(self) -> str:
        return f"PackedRows(rows {self.start}:{self.stop} of {self.packed.out_features})"


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
        # One matmul for Q, K and V: rows [Q | K | V] of one weight (vLLM's QKVParallelLinear, on one GPU).
        self.qkv_proj = Linear(hidden, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim)
        self.o_proj = Linear(self.n_heads * self.head_dim, hidden)

    # The three projections of the textbook layer, as views of the packed one.
    @property
    def q_proj(self) -> PackedRows:
        return PackedRows(self.qkv_proj, 0, self.n_heads * self.head_dim)

    @property
    def k_proj(self) -> PackedRows:
        start = self.n_heads * self.head_dim
        return PackedRows(self.qkv_proj, start, start + self.n_kv_heads * self.head_dim)

    @property
    def v_proj(self) -> PackedRows:
        start = (self.n_heads + self.n_kv_heads) * self.head_dim
        return PackedRows(self.qkv_proj, start, start + self.n_kv_heads * self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``x [..., hidden]`` (``[B, T, hidden]``, or ``[N, hidden]`` for a packed step) -> the same shape."""
        lead, d = x.shape[:-1], self.head_dim
        qkv = self.qkv_proj(x).view(*lead, self.n_heads + 2 * self.n_kv_heads, d)  # [..., Hq + 2 Hkv, D]
        if getattr(attn, "applies_rope", False):  # one kernel rotates, stores and attends; cos, sin: whole tables
            out = attn.attend_qkv(self.layer_idx, qkv, cos, sin)
        else:
            # Q and K sit side by side in the packed output: RoPE rotates both heads' groups in one call.
            qk, v = qkv.split((self.n_heads + self.n_kv_heads, self.n_kv_heads), dim=-2)
            q, k = rope(qk, cos, sin).split((self.n_heads, self.n_kv_heads), dim=-2)  # [..., H, D]: token-major views
            out = attn(self.layer_idx, q, k, v)  # the backend stores K/V (or not) and attends
        return self.o_proj(out.reshape(*lead, self.n_heads * d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up from one packed matmul."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)  # [gate | up]
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    @property
    def gate_proj(self) -> PackedRows:
        return PackedRows(self.gate_up_proj, 0, self.intermediate_size)

    @property
    def up_proj(self) -> PackedRows:
        return PackedRows(self.gate_up_proj, self.intermediate_size, 2 * self.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, cos, sin, attn, normed: bool = False):
        """``x + attn(norm(x))``, then ``+ mlp(norm(...))``, with each add fused into the norm after it:
        returns ``(mlp output, residual)``, whose sum is the layer's output (``residual=None``: the first layer).
        ``normed``: ``x`` is this layer's input norm already, ``residual`` its input (the first layer's norm is
        fused with the embedding lookup, :func:`~kvcourse.kernels.fused.embed_rms_norm`)."""
        if residual is None and not normed:
            x, residual = self.input_layernorm(x), x
        elif not normed:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def pack_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with Hugging Face's names (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``,
    ``up_proj``) -> this model's packed ``qkv_proj`` and ``gate_up_proj`` (rows concatenated); other
    entries unchanged. A dict that is already packed is returned as it is."""
    packed = dict(state)
    for name in [k for k in state if k.endswith("self_attn.q_proj.weight")]:
        prefix = name.removesuffix("q_proj.weight")
        parts = [packed.pop(prefix + f"{p}_proj.weight") for p in "qkv"]
        packed[prefix + "qkv_proj.weight"] = torch.cat(parts)
    for name in [k for k in state if k.endswith("mlp.gate_proj.weight")]:
        prefix = name.removesuffix("gate_proj.weight")
        parts = [packed.pop(prefix + f"{p}_proj.weight") for p in ("gate", "up")]
        packed[prefix + "gate_up_proj.weight"] = torch.cat(parts)
    return packed


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
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (cos, sin)
        self._rope_signed: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, dtype) -> (cos, signed sin)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCacheLike | None = None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer torch.Tensor [B, T], got {type(input_ids).__name__}")
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        self.check_token_ids(input_ids, "input_ids")  # before the copy: host ids are checked on the host
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
        return self.lm_head(self.hidden_states(input_ids, positions, attn, num_positions=start + input_ids.shape[1]))

    @torch.inference_mode()
    def forward_batch(
        self, batch: ForwardBatch, kv_pool, backend: str | type = "paged-torch", all_logits: bool = False
    ) -> torch.Tensor:
        """One ragged step on a paged pool: logits ``[B, vocab]`` at each sequence's last new token.

        ``backend``: a paged backend's name (:mod:`kvcourse.backends`) or its class (a runner looks it up once).

        ``all_logits=True`` returns ``[N, vocab]``, one row per packed token. The caller has already
        allocated every slot the batch writes (copy-on-write copies included).
        """
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a kvcourse.batch.ForwardBatch, got {type(batch).__name__}")
        if batch.block_size != kv_pool.block_size:
            raise ValueError(
                f"batch.block_size ({batch.block_size}) must equal kv_pool.block_size ({kv_pool.block_size})"
            )
        if batch.max_block_host >= kv_pool.num_blocks:
            raise ValueError(
                f"batch.block_tables name block {batch.max_block_host}, but kv_pool has {kv_pool.num_blocks} blocks"
            )
        batch.check()  # a batch made by hand is checked here, once; a built one already was
        self.check_context(batch.max_seq_len)
        lo, hi = batch.token_range_host  # read on the host when the batch was built: no read back
        if lo < 0 or hi >= self.config.vocab_size:
            self.check_token_ids(batch.input_ids, "batch.input_ids")  # raises, naming the bad ids
        batch = batch.to(self.device)
        backend_cls = backend if isinstance(backend, type) else backend_class(backend)
        hidden = self.step_hidden_states(batch, backend_cls(kv_pool, batch))
        if not all_logits:
            hidden = hidden[batch.last_token_indices]  # only the rows whose next token we need
        return self.lm_head(hidden)

    def step_hidden_states(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """The decoder stack over one packed step (``batch`` on the model's device, already checked):
        final-norm hidden states ``[N, hidden]``. Nothing here reads a value back from the device, so
        a CUDA graph can capture it (:mod:`kvcourse.serving.step_graphs`)."""
        return self.hidden_states(batch.input_ids, batch.positions, attn, num_positions=batch.max_seq_len)

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

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, num_positions: int | None = None
    ) -> torch.Tensor:
        """The decoder stack: ``input_ids [B, T]`` at ``positions [T]`` -> final-norm hidden states ``[B, T, hidden]``
        (or a packed step: ``[N]`` at ``[N]`` -> ``[N, hidden]``). ``num_positions``: more than the largest
        position, if the caller knows it (else it is read from ``positions``, a read back on a GPU)."""
        if getattr(attn, "applies_rope", False):  # the backend reads the tables at the step's positions itself
            cos, sin = self.rope_tables_signed(positions.device, num_positions or int(positions.max()) + 1)
        else:
            cos, sin = self.rope_rows(positions, num_positions)
        if self.layers:  # the embedding lookup and the first layer's norm: one kernel on a GPU
            first = self.layers[0].input_layernorm
            x, residual = embed_rms_norm(input_ids, self.embed_tokens.weight, first.weight, first.eps)
        else:
            x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, attn, normed=i == 0)
        return self.norm(x, residual)[0]

    def rope_rows(self, positions: torch.Tensor, num_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (:func:`~kvcourse.kernels.fused.rope_tables_signed`) at ``positions``,
        ``[T, 1, D]`` in the model's dtype: rows of tables kept per device (see :meth:`rope_tables`)."""
        if num_positions is None:
            num_positions = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self.rope_tables_signed(positions.device, num_positions)
        return cos[positions][:, None], sin[positions][:, None]  # [T, 1, D]: broadcast over heads

    def rope_tables_signed(self, device: torch.device, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables :meth:`rope_rows` reads, ``[L, D]`` with ``L >= num_positions``, in the model's dtype."""
        key = (device, self.dtype)
        cos, sin = self._rope_signed.get(key, (None, None))
        if cos is None or cos.shape[0] < num_positions:
            full_cos, full_sin = self._rope_table(num_positions, device)
            cos, sin = rope_tables_signed(full_cos.to(self.dtype), full_sin.to(self.dtype))
            self._rope_signed[key] = (cos, sin)
        return cos, sin

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position up to the largest in ``positions``, ``[L, D]``: computed once and
        kept (grown by doubling), so a decode step looks its rows up instead of recomputing them."""
        return self._rope_table(int(positions.max()) + 1 if positions.numel() else 1, positions.device)

    def _rope_table(self, needed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 tables of at least ``needed`` positions on ``device`` (a tensor's device: ``cuda:0``)."""
        cos, sin = self._rope_tables.get(device, (None, None))
        if cos is None or cos.shape[0] < needed:
            length = min(
                max(needed, 2 * (0 if cos is None else cos.shape[0]), 256), self.config.max_position_embeddings
            )
            cos, sin = rope_cos_sin(torch.arange(length, device=device), self.config.head_dim, self.config.rope_theta)
            self._rope_tables[device] = (cos, sin)
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
