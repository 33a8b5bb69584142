"""Token dropping: keep the cached tokens attention uses, drop the rest.

Attention is sparse in practice: most of a query's weight lands on a few keys. If the cache knew in
advance which keys later queries will need, it could drop the others. Three ways to guess, each
run once on a prompt after its prefill (the protocol of NVIDIA's ``kvpress``), keeping ``budget``
tokens per KV head:

* ``"h2o"`` -- Zhang et al., *H2O: Heavy-Hitter Oracle* (NeurIPS 2023): the tokens that received
  the most attention, summed over every query so far (the *heavy hitters*), plus the most recent
  tokens, half the budget each. (H2O also evicts during decode, one token per step; we compress once.)
* ``"snapkv"`` -- Li et al., *SnapKV* (2024): the attention of the prompt's last
  ``observation_window`` queries only (at the end of a prompt sits the question), smoothed over
  neighbouring tokens by max-pooling so that whole phrases survive, plus the observation window itself.
* ``"streaming"`` -- the StreamingLLM baseline: the first ``num_sinks`` tokens and the most recent.

Each KV head chooses its own tokens, so :meth:`DroppingKVCache.key_positions` is ``[B, H_kv, S]``.
The cache sees attention weights through ``observe_attention``, which the attention backend calls
for any cache that has it (see :class:`kvcourse.backends.ContiguousBackend`).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..cache import check_update
from ..checks import check_int, check_ints
from ..utils import check_config

__all__ = [
    "DroppingKVCache",
    "METHODS",
    "compressed_continuation_logits",
    "generate_compressed",
    "prefill",
    "prefill_prompt",
    "select_tokens",
]

METHODS = ("h2o", "snapkv", "streaming")


def select_tokens(
    method: str,
    budget: int,
    accumulated: torch.Tensor,
    window_scores: torch.Tensor,
    positions: torch.Tensor,
    observation_window: int = 32,
    pool_kernel: int = 7,
    num_sinks: int = 4,
) -> torch.Tensor:
    """Indices ``[B, H, budget]`` (ascending) of the tokens to keep, per KV head.

    ``accumulated``: attention each token received from every query so far ``[B, H, S]``;
    ``window_scores``: from the last ``observation_window`` queries only; ``positions [B, H, S]``.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    s = positions.shape[-1]
    check_int("budget", budget, min=1, max=s)  # at most the tokens held
    # Rank by recency first: the newest token has rank 0.
    recency = positions.argsort(-1, descending=True).argsort(-1)
    if method == "h2o":
        recent = budget // 2
        score = accumulated.clone()
    elif method == "snapkv":
        recent = min(observation_window, budget)
        score = F.max_pool1d(window_scores.flatten(0, 1)[:, None], pool_kernel, stride=1, padding=pool_kernel // 2)
        score = score[:, 0].view_as(window_scores)
    else:
        recent = max(budget - num_sinks, 0)
        score = -positions.to(torch.float32)  # the earliest tokens first: the sinks
    # Recent tokens are kept whatever their score; the rest of the budget goes to the best scores.
    score = score.masked_fill(recency < recent, float("inf"))
    keep = score.topk(budget, dim=-1).indices
    return keep.sort(-1).values


class _Layer:
    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [B, H, S, D]
        self.v: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None  # [B, H, S] int64
        self.accumulated: torch.Tensor | None = None  # [B, H, S]: attention received from every query so far
        self.window_scores: torch.Tensor | None = None  # [B, H, S]: from the last observation_window queries
        self.length = 0


class DroppingKVCache:
    """A contiguous cache that scores its tokens by the attention they receive and can drop the least used.

    Use it like a ``KVCache`` for the prefill, call :meth:`compress` with a budget, then continue
    (decode or more text): new tokens are appended after the kept ones.
    """

    def __init__(
        self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, observation_window: int = 32
    ) -> None:
        check_ints(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   observation_window=observation_window)  # fmt: skip
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.observation_window = observation_window
        self._layers = [_Layer() for _ in range(num_layers)]

    @classmethod
    def for_model(cls, config, batch_size: int = 1, observation_window: int = 32) -> DroppingKVCache:
        """A cache shaped for ``config`` (``model.config``)."""
        check_config(config)
        return cls(
            config.num_hidden_layers, batch_size, config.num_key_value_heads, config.head_dim, observation_window
        )

    # ---- what the model calls -------------------------------------------------
    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v [B, H_kv, T, D]`` after the kept tokens; return what the layer holds."""
        check_update(self, layer_idx, k, v)
        layer = self._layers[layer_idx]
        b, h, t, _ = k.shape
        new_pos = torch.arange(layer.length, layer.length + t, device=k.device).expand(b, h, t)
        zeros = k.new_zeros(b, h, t)
        if layer.k is None:
            layer.k, layer.v, layer.pos = k.clone(), v.clone(), new_pos.clone()
            layer.accumulated, layer.window_scores = zeros, zeros.clone()
        else:
            layer.k, layer.v = torch.cat([layer.k, k], 2), torch.cat([layer.v, v], 2)
            layer.pos = torch.cat([layer.pos, new_pos], 2)
            layer.accumulated = torch.cat([layer.accumulated, zeros], 2)
            layer.window_scores = torch.cat([layer.window_scores, zeros], 2)
        layer.length += t
        return layer.k, layer.v

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """Positions ``[B, H_kv, S]`` of the tokens each KV head holds."""
        return self._layers[layer_idx].pos

    def observe_attention(self, layer_idx: int, probs: torch.Tensor) -> None:
        """Add this forward's attention weights ``[B, Hq, T, S]`` to each held token's scores."""
        layer = self._layers[layer_idx]
        b, hq, t, s = probs.shape
        per_kv_head = probs.reshape(b, self.num_kv_heads, hq // self.num_kv_heads, t, s).sum(2)  # GQA group
        layer.accumulated += per_kv_head.sum(2)
        layer.window_scores = per_kv_head[:, :, -self.observation_window :].sum(2)

    # ---- dropping ------------------------------------------------------------
    def compress(self, budget: int, method: str = "snapkv", pool_kernel: int = 7, num_sinks: int = 4) -> None:
        """Keep ``budget`` tokens per KV head in every layer, chosen by ``method`` (see the module docstring)."""
        for layer in self._layers:
            if layer.k is None:
                raise ValueError("compress needs a prefilled cache: run the prompt through the model first")
            keep = select_tokens(method, budget, layer.accumulated, layer.window_scores, layer.pos,
                                 self.observation_window, pool_kernel, num_sinks)  # fmt: skip
            gather = keep[..., None].expand(*keep.shape, self.head_dim)
            layer.k, layer.v = layer.k.gather(2, gather), layer.v.gather(2, gather)
            layer.pos = layer.pos.gather(2, keep)
            layer.accumulated = layer.accumulated.gather(2, keep)
            layer.window_scores = layer.window_scores.gather(2, keep)

    # ---- what readers look at -------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens seen so far: the position of the next token."""
        return self._layers[0].length

    @property
    def num_held(self) -> int:
        """Tokens each KV head holds."""
        layer = self._layers[0]
        return 0 if layer.k is None else layer.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V held, every layer."""
        return sum(2 * l.k.numel() * l.k.element_size() for l in self._layers if l.k is not None)

    def __len__(self) -> int:
        return self.seq_len

    def __repr__(self) -> str:
        return (
            f"DroppingKVCache(layers={self.num_layers}, batch={self.batch_size}, seq_len={self.seq_len}, "
            f"held={self.num_held}, nbytes={self.nbytes:,})"
        )


# ---------------------------------------------------------------------------------------------
# The two ways chapter 8 measures a dropping policy
# ---------------------------------------------------------------------------------------------
@torch.inference_mode()
def prefill(model, ids, observation_window: int = 32) -> DroppingKVCache:
    """A :class:`DroppingKVCache` holding ``ids``, its attention scores recorded."""
    cache = DroppingKVCache.for_model(model.config, observation_window=observation_window)
    model(torch.tensor([list(ids)], device=model.device), cache=cache)
    return cache


@torch.inference_mode()
def compressed_continuation_logits(
    model, context, continuation, budget: int | None, method: str = "snapkv", prefilled: DroppingKVCache | None = None
) -> torch.Tensor:
    """Prefill ``context``, keep ``budget`` of its tokens (``None``: all), then read ``continuation``.

    Returns the logits ``[len(continuation), vocab]`` (float32) computed over the compressed cache:
    row ``i`` predicts ``continuation[i + 1]``. ``prefilled``: ``prefill(model, context)``, done once
    for several budgets (it is copied, not changed).
    """
    cache = prefill(model, context) if prefilled is None else copy.deepcopy(prefilled)
    if budget is not None:
        cache.compress(budget, method)
    return model(torch.tensor([list(continuation)], device=model.device), cache=cache)[0].float()


@torch.inference_mode()
def prefill_prompt(model, prompt, observation_window: int = 32) -> tuple[DroppingKVCache, int]:
    """Prefill all of ``prompt`` with the full cache: the cache (attention recorded) and the greedy first
    token, which the full prompt's own logits give before anything is dropped (SnapKV's protocol)."""
    cache = DroppingKVCache.for_model(model.config, observation_window=observation_window)
    logits = model(torch.tensor([list(prompt)], device=model.device), cache=cache)
    return cache, int(logits[0, -1].argmax())


def generate_compressed(model, prompt, budget: int | None, method: str = "snapkv", max_new_tokens: int = 16,
                        prefilled: tuple[DroppingKVCache, int] | None = None) -> list[int]:  # fmt: skip
    """Greedy tokens: prefill all of ``prompt``, take the first token from its logits, keep ``budget`` of
    the prompt's tokens (``None``: all), and decode the rest on the compressed cache.

    The first token is the full cache's (the prefill saw every token); compression costs only the
    tokens after it. ``prefilled``: ``prefill_prompt(model, prompt)``, done once for several budgets
    (copied, not changed).
    """
    from ..generation import generate

    check_int("max_new_tokens", max_new_tokens, min=1)
    cache, first = prefill_prompt(model, prompt) if prefilled is None else copy.deepcopy(prefilled)
    if budget is not None:
        cache.compress(min(budget, cache.num_held), method)
    if max_new_tokens == 1 or first in (model.config.eos_token_id or ()):
        return [first]
    return [first] + generate(model, [first], max_new_tokens - 1, cache=cache)
