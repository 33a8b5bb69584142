"""Checks for chapter 2, *The KV cache: prefill and decode*.

1. :func:`check_cache_bytes` -- bytes of SmolLM2-135M's KV cache after ``num_tokens`` tokens.
2. :func:`check_request_latency` -- end-to-end latency of a request from TTFT and TPOT.
3. :func:`check_decode_attention` -- one decode step of attention against the cache, with GQA.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..kernels.reference import decode_attention_ref
from ._core import ExerciseError, expect_close, passed, call_learner

__all__ = ["check_cache_bytes", "check_request_latency", "check_decode_attention", "smollm2_cache_bytes"]

# SmolLM2-135M: 30 layers, 3 KV heads of dimension 64 (9 query heads, which the cache never stores).
_LAYERS, _KV_HEADS, _HEAD_DIM, _Q_HEADS = 30, 3, 64, 9


def smollm2_cache_bytes(num_tokens: int, bytes_per_value: int = 4, batch_size: int = 1) -> int:
    """The reference answer: 2 (K and V) x layers x KV heads x head_dim x tokens x batch x bytes."""
    return 2 * _LAYERS * _KV_HEADS * _HEAD_DIM * num_tokens * batch_size * bytes_per_value


_call = call_learner


def check_cache_bytes(cache_bytes: Callable[[int, int], int]) -> bool:
    """``cache_bytes(num_tokens, bytes_per_value)`` must give SmolLM2-135M's cache size in bytes (batch 1)."""
    cases = [(1, 4), (1, 2), (100, 2), (1000, 4), (8192, 2), (8192, 1)]
    for num_tokens, nbytes in cases:
        got = _call("cache_bytes", cache_bytes, num_tokens, nbytes)
        want = smollm2_cache_bytes(num_tokens, nbytes)
        if isinstance(got, (int, float)) and not isinstance(got, bool) and got:
            ratio = want / got
            if math.isclose(ratio, 2.0):
                hint = "Is something stored twice per token and layer? Count K *and* V."
            elif math.isclose(ratio, 1 / 3):
                hint = "Which heads does the cache hold: the 9 query heads or the 3 KV heads (GQA)?"
            elif math.isclose(ratio, 1 / 1.5) or math.isclose(ratio, 0.4):
                hint = "Q is never cached: only K and V."
            else:
                hint = "Multiply: 2 (K and V) x layers x KV heads x head_dim x tokens x bytes per value."
        else:
            hint = "Return a number of bytes."
        expect_close(f"cache_bytes({num_tokens}, {nbytes})", got, want, rel=1e-9, hint=hint)
    return passed(
        f"SmolLM2-135M caches {smollm2_cache_bytes(1, 2):,} bytes per token in fp16/bf16 "
        f"({smollm2_cache_bytes(8192, 2) / 2**20:.0f} MiB at its 8192-token context)."
    )


def check_request_latency(latency: Callable[[float, float, int], float]) -> bool:
    """``latency(ttft_s, tpot_s, new_tokens)`` must give the seconds until the last of ``new_tokens`` arrives."""
    cases = [(0.5, 0.02, 1), (0.5, 0.02, 2), (0.12, 0.03, 100), (2.0, 0.01, 500), (0.0, 0.05, 10)]
    for ttft, tpot, n in cases:
        got = _call("latency", latency, ttft, tpot, n)
        want = ttft + (n - 1) * tpot
        hint = (
            "The first token arrives after TTFT (prefill + first pick); each of the other tokens costs one TPOT."
            if isinstance(got, (int, float)) and math.isclose(float(got), ttft + n * tpot)
            else "Which phase produces the first token, and how many decode steps follow it?"
        )
        expect_close(f"latency({ttft}, {tpot}, {n})", got, want, rel=1e-9, hint=hint)
    return passed("latency = TTFT + (new_tokens - 1) x TPOT: prefill once, then one decode step per extra token.")


def check_decode_attention(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """``attend(q [B, Hq, D], k [B, Hkv, S, D], v [B, Hkv, S, D]) -> [B, Hq, D]``: one decode step.

    Compared with :func:`kvcourse.decode_attention_ref` on random inputs with SmolLM2's
    GQA shape (9 query heads, 3 KV heads), plain multi-head attention, and a one-token cache.
    """
    gen = torch.Generator().manual_seed(2)
    shapes = [(1, _Q_HEADS, _KV_HEADS, 17, _HEAD_DIM), (2, 4, 4, 5, 8), (3, 6, 2, 1, 16), (2, 8, 1, 33, 32)]
    for b, hq, hkv, s, d in shapes:
        q = torch.randn(b, hq, d, generator=gen)
        k = torch.randn(b, hkv, s, d, generator=gen) * 2.0
        v = torch.randn(b, hkv, s, d, generator=gen)
        want = decode_attention_ref(q, k, v)
        got = _call("attend", attend, q, k, v)
        where = f"q {list(q.shape)}, k/v {list(k.shape)}"
        if not isinstance(got, torch.Tensor):
            raise ExerciseError(f"attend should return a torch.Tensor, got {type(got).__name__} ({where}).")
        if tuple(got.shape) != (b, hq, d):
            raise ExerciseError(
                f"attend returned shape {list(got.shape)} for {where}; expected [B, Hq, D] = {[b, hq, d]}."
            )
        if not torch.allclose(got.float(), want, atol=1e-5, rtol=1e-4):
            raise ExerciseError(f"attend's output differs from the reference for {where}. {_diagnose(q, k, v, got)}")
    return passed("one query per head against every cached key, softmax, then a weighted sum of the cached values.")


def _diagnose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, got: torch.Tensor) -> str:
    """Name the usual mistake by checking the output against the usual wrong answers."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    group = hq // hkv
    interleaved = torch.arange(hq) % hkv  # query head h reads KV head h % Hkv: wrong
    if hkv not in (1, hq):
        kk, vv = k[:, interleaved], v[:, interleaved]
        wrong = torch.einsum("bhs,bhsd->bhd", torch.softmax(torch.einsum("bhd,bhsd->bhs", q, kk) / math.sqrt(d), -1), vv)
        if torch.allclose(got.float(), wrong, atol=1e-5, rtol=1e-4):
            return f"Query head h must read KV head h // {group} (consecutive query heads share a KV head), not h % {hkv}."
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q, kk)
    if torch.allclose(got.float(), torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, -1), vv), atol=1e-5, rtol=1e-4):
        return "Did you scale the scores by 1/sqrt(head_dim) before the softmax?"
    if torch.allclose(got.float(), torch.einsum("bhs,bhsd->bhd", scores / math.sqrt(d), vv), atol=1e-5, rtol=1e-4):
        return "The scores need a softmax over the cached positions before they weight the values."
    return "Check the GQA head mapping, the 1/sqrt(head_dim) scale and the softmax axis (over cached positions S)."
