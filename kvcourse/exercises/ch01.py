"""Checks for chapter 1, *Naive generation and the work that repeats*.

Each check prints a confirmation on a right answer and raises
:class:`~kvcourse.exercises.ExerciseError` with a hint on a wrong one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..costs import kv_projections_total
from ._core import ExerciseError, expect_close, expect_equal, passed

__all__ = [
    "FROZEN_CHOICES",
    "check_naive_kv_projections",
    "check_frozen_tensors",
    "check_causal_mask",
    "check_projection_ratio",
]

# --- Exercise 1: the closed form for naive K/V projections ---------------------------------------

_PROJECTION_CASES = [(1, 0, 1), (1, 1, 1), (5, 1, 30), (5, 2, 1), (5, 20, 30), (1, 1000, 1), (42, 300, 30), (7, 13, 2)]


def check_naive_kv_projections(fn: Callable[[int, int, int], int]) -> bool:
    """``fn(prompt_len, new_tokens, num_layers)`` -> K/V vectors (per KV head) the naive loop computes in total."""
    if not callable(fn):
        raise ExerciseError(f"pass a function fn(prompt_len, new_tokens, num_layers), got {type(fn).__name__}")
    for p, n, layers in _PROJECTION_CASES:
        want = kv_projections_total(p, n, use_cache=False, num_layers=layers)
        got = fn(p, n, layers)
        if isinstance(got, float) and got.is_integer():
            got = int(got)
        if got == want:
            continue
        hint = "Step i feeds prompt_len + i tokens (i = 0 .. new_tokens-1), through every layer."
        if got == kv_projections_total(p, n, use_cache=True, num_layers=layers):
            hint = "That is the count with a cache (each token once); the naive loop re-feeds the whole sequence."
        elif n and got == (n * p + n * (n + 1) // 2) * layers:
            hint = "Off by one step's worth: step 0 feeds only the prompt, so the extra tokens are 0 + 1 + ... + (n-1)."
        elif n and got == (n * p + n * (n - 1) // 2):
            hint = "Right per layer; every one of num_layers layers computes its own K and V."
        elif n == 0:
            hint = "With new_tokens = 0 no step runs, so nothing is computed."
        raise ExerciseError(f"fn({p}, {n}, {layers}) = {got!r} is not right. {hint}")
    return passed("the naive loop computes n*P + n(n-1)/2 K/V vectors per layer: quadratic in n.")


# --- Exercise 2: which tensors stay identical across naive steps ---------------------------------

FROZEN_CHOICES = {
    "past_k": "K of positions 0..P-1",
    "past_v": "V of positions 0..P-1",
    "past_q": "Q of positions 0..P-1",
    "past_attn_out": "attention output of positions 0..P-1",
    "last_q": "Q of the last position (the one that predicts the next token)",
    "last_logits": "logits of the last position",
    "tokens_fed": "the number of tokens fed to the model",
}
_FROZEN = {"past_k", "past_v", "past_q", "past_attn_out"}
_FROZEN_HINTS = {
    "past_k": "A past token's K depends only on tokens at or before it (causal mask), and RoPE uses its fixed position.",
    "past_v": "A past token's V depends only on tokens at or before it.",
    "past_q": "Causality freezes *everything* computed for a past position, Q included. "
    "Q is not cached because no later step reads it, not because it changes.",
    "past_attn_out": "A past position attends only to itself and earlier positions, none of which changed.",
    "last_q": "The last position is a new token every step, so its query is new too.",
    "last_logits": "The last position's logits predict a different next token every step.",
    "tokens_fed": "The naive loop feeds one more token every step.",
}


def check_frozen_tensors(answer: set[str] | list[str] | tuple[str, ...]) -> bool:
    """``answer``: the keys of :data:`FROZEN_CHOICES` that are identical at every naive step (up to rounding)."""
    if isinstance(answer, str) or not isinstance(answer, (set, list, tuple, frozenset)):
        raise ExerciseError(f"answer should be a set of keys from FROZEN_CHOICES, got {type(answer).__name__}")
    answer = set(answer)
    unknown = answer - FROZEN_CHOICES.keys()
    if unknown:
        raise ExerciseError(f"unknown choices {sorted(unknown)}; pick from {sorted(FROZEN_CHOICES)}")
    missing = [c for c in ("past_q", "past_k", "past_v", "past_attn_out") if c in _FROZEN - answer]
    extra = [c for c in FROZEN_CHOICES if c in answer - _FROZEN]
    if missing or extra:
        problems = [f"'{m}' is frozen too: {_FROZEN_HINTS[m]}" for m in missing]
        problems += [f"'{e}' changes: {_FROZEN_HINTS[e]}" for e in extra]
        raise ExerciseError("Not quite. " + " ".join(problems[:1]) + f" ({len(problems)} choice(s) wrong.)")
    return passed("every past position's Q, K, V and attention output is frozen; only K and V are ever read again.")


# --- Exercise 3: predict the causal mask ---------------------------------------------------------

_MASK_CASES = [(4, 4), (1, 6), (3, 7), (6, 6), (1, 1)]


def _reference_mask(num_queries: int, num_keys: int) -> torch.Tensor:
    q_pos = torch.arange(num_queries)[:, None] + (num_keys - num_queries)
    return torch.arange(num_keys)[None, :] <= q_pos


def _diagonal(num_queries: int, num_keys: int) -> torch.Tensor:
    q_pos = torch.arange(num_queries)[:, None] + (num_keys - num_queries)
    return torch.arange(num_keys)[None, :] == q_pos


def check_causal_mask(fn: Callable[[int, int], torch.Tensor]) -> bool:
    """``fn(num_queries, num_keys)`` -> bool ``[num_queries, num_keys]``, True where the query may attend.

    The queries are the *last* ``num_queries`` of the ``num_keys`` positions.
    """
    if not callable(fn):
        raise ExerciseError(f"pass a function fn(num_queries, num_keys), got {type(fn).__name__}")
    for tq, s in _MASK_CASES:
        got = fn(tq, s)
        want = _reference_mask(tq, s)
        if not isinstance(got, torch.Tensor):
            raise ExerciseError(f"fn({tq}, {s}) should return a torch.Tensor, got {type(got).__name__}")
        expect_equal(f"fn({tq}, {s}).shape", tuple(got.shape), tuple(want.shape), "Rows are queries, columns keys.")
        if got.dtype != torch.bool:
            raise ExerciseError(f"fn({tq}, {s}) should be a bool tensor (True = may attend), got {got.dtype}")
        if torch.equal(got, want):
            continue
        if torch.equal(got, want & ~_diagonal(tq, s)):
            hint = "Each query may attend to its own position too (the diagonal)."
        elif torch.equal(got, ~want):
            hint = "It is inverted: True should mark the keys a query MAY attend to."
        elif tq == s and torch.equal(got, want.T):
            hint = "It is transposed: a query may look back (columns <= its row), never ahead."
        elif tq != s and torch.equal(got, torch.ones(tq, s, dtype=torch.bool).tril()):
            hint = "The queries are the LAST num_queries positions: query i sits at position num_keys - num_queries + i."
        else:
            hint = "Query i at position p may attend to keys 0..p."
        raise ExerciseError(f"fn({tq}, {s}) is not the causal mask. {hint}")
    return passed("a query at position p sees keys 0..p; with queries at the end, that is the cache's mask too.")


# --- Exercise 4: test the "500x" claim -----------------------------------------------------------


def check_projection_ratio(ratio: float, prompt_len: int = 5, new_tokens: int = 1000) -> bool:
    """``ratio``: naive K/V projections divided by cached ones, for ``prompt_len`` and ``new_tokens``."""
    want = kv_projections_total(prompt_len, new_tokens, False) / kv_projections_total(prompt_len, new_tokens, True)
    expect_close(
        "ratio",
        ratio,
        want,
        rel=1e-4,
        hint="Naive: n*P + n(n-1)/2 per layer. Cached: P + n - 1 per layer (the last token is never fed back). "
        "Layers cancel.",
    )
    return passed(f"{want:.1f}x more K/V projections naively: about n/2 once n >> P.")
