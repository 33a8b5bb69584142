"""Chapter 1's checks accept right answers and reject wrong ones with a useful hint."""

from __future__ import annotations

import pytest
import torch

from kvcourse.exercises import ExerciseError, ch01


# --- exercise 1 ---------------------------------------------------------------------------------
def right_count(p, n, layers):
    return (n * p + n * (n - 1) // 2) * layers


def test_projections_accept_right_answer(capsys):
    assert ch01.check_naive_kv_projections(right_count)
    assert "Correct" in capsys.readouterr().out


def test_projections_accept_integral_floats():
    assert ch01.check_naive_kv_projections(lambda p, n, layers: float(right_count(p, n, layers)))


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda p, n, layers: (p + n - 1) * layers if n else 0, "with a cache"),
        (lambda p, n, layers: (n * p + n * (n + 1) // 2) * layers, "Off by one"),
        (lambda p, n, layers: n * p + n * (n - 1) // 2, "every one of num_layers"),
        (lambda p, n, layers: (n * p + n * (n - 1) // 2) * layers if n else p * layers, "no step runs"),
        (lambda p, n, layers: n * p * layers, "prompt_len \\+ i"),
    ],
)
def test_projections_reject_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch01.check_naive_kv_projections(wrong)


def test_projections_reject_non_function():
    with pytest.raises(ExerciseError, match="function"):
        ch01.check_naive_kv_projections(42)


# --- exercise 2 ---------------------------------------------------------------------------------
RIGHT_FROZEN = {"past_k", "past_v", "past_q", "past_attn_out"}


def test_frozen_accepts_right_answer_in_any_container():
    assert ch01.check_frozen_tensors(RIGHT_FROZEN)
    assert ch01.check_frozen_tensors(sorted(RIGHT_FROZEN))


@pytest.mark.parametrize(
    ("answer", "hint"),
    [
        ({"past_k", "past_v"}, "Q is not cached because no later step reads it"),
        (RIGHT_FROZEN | {"last_q"}, "'last_q' changes"),
        (RIGHT_FROZEN | {"tokens_fed"}, "'tokens_fed' changes"),
        (RIGHT_FROZEN - {"past_attn_out"}, "'past_attn_out' is frozen too"),
        (RIGHT_FROZEN | {"keys"}, "unknown choices"),
        ("past_k", "set of keys"),
    ],
)
def test_frozen_rejects_wrong_answers(answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch01.check_frozen_tensors(answer)


def test_frozen_choices_are_documented():
    assert RIGHT_FROZEN < set(ch01.FROZEN_CHOICES)


# --- exercise 3 ---------------------------------------------------------------------------------
def right_mask(tq, s):
    rows = torch.arange(tq)[:, None] + (s - tq)
    return torch.arange(s)[None, :] <= rows


def test_mask_accepts_right_answer():
    assert ch01.check_causal_mask(right_mask)


def test_mask_accepts_tril_with_diagonal_offset():
    assert ch01.check_causal_mask(lambda tq, s: torch.ones(tq, s, dtype=torch.bool).tril(s - tq))


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda tq, s: ~right_mask(tq, s), "inverted"),
        (lambda tq, s: right_mask(tq, s).T if tq == s else right_mask(tq, s), "transposed"),
        (lambda tq, s: torch.ones(tq, s, dtype=torch.bool).tril(s - tq - 1), "diagonal"),
        (lambda tq, s: torch.ones(tq, s, dtype=torch.bool).tril(), "LAST num_queries"),
        (lambda tq, s: right_mask(tq, s).int(), "bool"),
        (lambda tq, s: right_mask(tq, s).tolist(), "torch.Tensor"),
        (lambda tq, s: right_mask(s, s), "shape"),
    ],
)
def test_mask_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch01.check_causal_mask(wrong)


# --- exercise 4 ---------------------------------------------------------------------------------
def test_ratio_accepts_right_answer():
    naive = 1000 * 5 + 1000 * 999 // 2
    cached = 5 + 999
    assert ch01.check_projection_ratio(naive / cached)
    assert ch01.check_projection_ratio(round(naive / cached, 1))


def test_ratio_other_lengths():
    assert ch01.check_projection_ratio((10 * 1 + 45) / 10, prompt_len=1, new_tokens=10)


@pytest.mark.parametrize("wrong", [500.0, 1000.0, (5000 + 499500) / 1005, "502"])
def test_ratio_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseError, match="ratio"):
        ch01.check_projection_ratio(wrong)
