"""Chapter 2's exercise checks accept right answers and reject wrong ones with a useful hint."""

from __future__ import annotations

import math

import pytest
import torch

import kvcourse
from kvcourse.exercises import ExerciseError, ch02

# ---- 1. cache bytes ----------------------------------------------------------


def test_cache_bytes_accepts_the_formula_and_matches_a_real_cache(model):
    assert ch02.check_cache_bytes(lambda n, b: 2 * 30 * 3 * 64 * n * b)
    cache = kvcourse.KVCache.for_model(model.config)
    model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=cache)
    assert cache.nbytes == ch02.smollm2_cache_bytes(7, bytes_per_value=4)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda n, b: 30 * 3 * 64 * n * b, "K \\*and\\* V"),  # forgot V
        (lambda n, b: 2 * 30 * 9 * 64 * n * b, "3 KV heads"),  # query heads
        (lambda n, b: 3 * 30 * 3 * 64 * n * b, "Q is never cached"),  # Q, K and V
        (lambda n, b: 2 * 30 * 3 * 64 * n * 4, "bytes per value"),  # ignores the dtype
        (lambda n, b: None, "Return a number"),
        (lambda n, b: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_cache_bytes_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch02.check_cache_bytes(wrong)


def test_cache_bytes_rejects_a_non_function():
    with pytest.raises(ExerciseError, match="pass a function"):
        ch02.check_cache_bytes(46080)


# ---- 2. request latency ------------------------------------------------------


def test_latency_accepts_ttft_plus_n_minus_one_tpot():
    assert ch02.check_request_latency(lambda ttft, tpot, n: ttft + (n - 1) * tpot)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda ttft, tpot, n: ttft + n * tpot, "each of the other tokens"),  # off by one
        (lambda ttft, tpot, n: n * tpot, "Which phase"),  # forgot prefill
        (lambda ttft, tpot, n: n * ttft, "Which phase"),  # every step a prefill
        (lambda ttft, tpot, n: "soon", "should be a number"),
    ],
)
def test_latency_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch02.check_request_latency(wrong)


# ---- 3. decode attention -----------------------------------------------------


def _right(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, dim=-1), v)


def _interleaved(q, k, v):  # query head h reads KV head h % Hkv
    idx = torch.arange(q.shape[1]) % k.shape[1]
    scores = torch.einsum("bhd,bhsd->bhs", q, k[:, idx]) / math.sqrt(q.shape[-1])
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, dim=-1), v[:, idx])


def _unscaled(q, k, v):
    return _right(q * math.sqrt(q.shape[-1]), k, v)


def _no_softmax(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.einsum("bhs,bhsd->bhd", torch.einsum("bhd,bhsd->bhs", q, k) / math.sqrt(q.shape[-1]), v)


def _last_value_only(q, k, v):
    return v[:, :, -1].repeat_interleave(q.shape[1] // k.shape[1], dim=1)


def test_decode_attention_accepts_a_correct_step_and_the_reference():
    assert ch02.check_decode_attention(_right)
    assert ch02.check_decode_attention(kvcourse.decode_attention_ref)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (_interleaved, "h // 3"),
        (_unscaled, "1/sqrt\\(head_dim\\)"),
        (_no_softmax, "need a softmax"),
        (_last_value_only, "differs from the reference"),
        (lambda q, k, v: q, "differs from the reference"),  # right shape, wrong values
        (lambda q, k, v: q[:, :, None], "expected \\[B, Hq, D\\]"),
        (lambda q, k, v: q.tolist(), "torch.Tensor"),
    ],
)
def test_decode_attention_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch02.check_decode_attention(wrong)
