"""Counting the work of generation, naive and cached, exactly.

Two counts, both for generating ``new_tokens`` tokens after a ``prompt_len``-token prompt:

* **K/V projections**: how many (token, layer) K/V vectors are computed. The naive
  loop recomputes every earlier token at every step; the cached loop computes
  each token once.
* **FLOPs**: multiply-adds x 2 of every matrix product in a forward pass of
  :class:`kvcourse.model.LlamaModel` (projections, attention scores and mixing,
  MLP, output head). Norms, RoPE and softmax are left out: they are O(hidden)
  per token, under 1% here.

Step ``i`` (``i = 0 .. new_tokens-1``) produces token ``i``. Before it the sequence
holds ``prompt_len + i`` tokens. The naive loop feeds all of them; the cached loop
feeds the prompt at step 0 (prefill) and one token afterwards (decode).
"""

from __future__ import annotations

from .checks import check_float, check_int

__all__ = [
    "matmul_parameters",
    "transformer_flops",
    "tokens_fed",
    "kv_projections_per_step",
    "kv_projections_total",
    "forward_flops",
    "generation_flops",
    "step_flops",
    "flop_scaled_ms",
]


def _check(prompt_len: int, new_tokens: int) -> None:
    check_int("prompt_len", prompt_len, min=1)
    check_int("new_tokens", new_tokens, min=0)


def tokens_fed(prompt_len: int, step: int, use_cache: bool) -> tuple[int, int]:
    """``(tokens fed to the model, position of the first one)`` at generation step ``step``."""
    _check(prompt_len, step)
    if not use_cache:
        return prompt_len + step, 0
    return (prompt_len, 0) if step == 0 else (1, prompt_len + step - 1)


def kv_projections_per_step(prompt_len: int, step: int, use_cache: bool, num_layers: int = 1) -> int:
    """K/V vectors computed at step ``step`` (per KV head; times ``num_layers``)."""
    return tokens_fed(prompt_len, step, use_cache)[0] * num_layers


def kv_projections_total(prompt_len: int, new_tokens: int, use_cache: bool, num_layers: int = 1) -> int:
    """K/V vectors computed over the whole generation (closed form).

    Naive: ``sum_{i<n} (P + i) = n P + n (n - 1) / 2`` -- quadratic in ``n``.
    Cached: ``P + (n - 1)`` -- linear (every token but the last generated one is projected once;
    the last one is never fed back). Zero when ``n == 0``.
    """
    _check(prompt_len, new_tokens)
    n, p = new_tokens, prompt_len
    if n == 0:
        return 0
    per_layer = n * p + n * (n - 1) // 2 if not use_cache else p + n - 1
    return per_layer * num_layers


def transformer_flops(matmul_params: int, num_layers: int, q_width: int, num_tokens: int, start_pos: int = 0) -> int:
    """FLOPs of one forward over ``num_tokens`` tokens at positions ``start_pos ..``: the one formula.

    ``2 x matmul_params`` per token for the products against the weights, plus ``2 x 2 x q_width``
    per (query, key) pair for attention's ``Q K^T`` and ``P V`` in each layer. Causal: the token at
    position ``p`` sees ``p + 1`` keys, cached or not.
    """
    if num_tokens < 1 or start_pos < 0:
        raise ValueError(f"need num_tokens >= 1 and start_pos >= 0, got {num_tokens}, {start_pos}")
    keys_seen = num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2  # (start+1) + ... + (start+n)
    return 2 * matmul_params * num_tokens + 2 * 2 * num_layers * q_width * keys_seen


def matmul_parameters(config) -> int:
    """Weights a token is multiplied by in :class:`kvcourse.model.LlamaModel`: projections, MLP, output head.

    The input embedding is a lookup, not a product; norms are left out (O(hidden) per token).
    """
    h, d = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * config.intermediate_size  # Q, K, V, O, SwiGLU
    return config.num_hidden_layers * per_layer + h * config.vocab_size


def forward_flops(config, num_tokens: int, start_pos: int = 0) -> int:
    """Matmul FLOPs of one forward pass of our model over ``num_tokens`` tokens at positions ``start_pos ..``.

    ``config`` is a :class:`kvcourse.model.LlamaConfig` (or anything with its field names).
    """
    q_width = config.num_attention_heads * config.head_dim
    return transformer_flops(matmul_parameters(config), config.num_hidden_layers, q_width, num_tokens, start_pos)


def step_flops(config, prompt_len: int, step: int, use_cache: bool) -> int:
    """FLOPs of generation step ``step``."""
    n, start = tokens_fed(prompt_len, step, use_cache)
    return forward_flops(config, n, start)


def generation_flops(config, prompt_len: int, new_tokens: int, use_cache: bool) -> int:
    """FLOPs to generate ``new_tokens`` tokens after a ``prompt_len``-token prompt."""
    _check(prompt_len, new_tokens)
    return sum(step_flops(config, prompt_len, i, use_cache) for i in range(new_tokens))


def flop_scaled_ms(config, measured_ms: float, measured_tokens: int, num_tokens: int) -> float:
    """Predict a forward pass over ``num_tokens`` tokens from one measured over ``measured_tokens``.

    The model the course checks its timings against: time in proportion to :func:`forward_flops`,
    attention's pairs included. It knows nothing of the fixed cost of reading every weight once per
    pass, so from a short pass, where that read is a large share of the time, it over-predicts a long one.
    """
    measured_ms = check_float("measured_ms", measured_ms, min=0)
    check_int("measured_tokens", measured_tokens, min=1)
    check_int("num_tokens", num_tokens, min=1)
    return measured_ms * forward_flops(config, num_tokens) / forward_flops(config, measured_tokens)
