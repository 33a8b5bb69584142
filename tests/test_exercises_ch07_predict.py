"""ch07.check_predicted_prefix_ttft: the reference answer passes, and each typical mistake gets its own hint."""

import pytest

from kvcourse.exercises import ExerciseError, ch07


def _ttft(prompt_len, cached, block, fixed_ms, per_token_ms, hit):
    return fixed_ms + per_token_ms * (prompt_len - hit)


def right(prompt_len, cached, block, fixed_ms, per_token_ms):
    # whole blocks of the cached prefix, the last prompt token always fed
    return _ttft(prompt_len, cached, block, fixed_ms, per_token_ms, min(cached, prompt_len - 1) // block * block)


def test_accepts_right_answer():
    assert ch07.check_predicted_prefix_ttft(right)
    assert ch07.check_predicted_prefix_ttft(right, seed=3)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda n, c, b, f, t: _ttft(n, c, b, f, t, min(c, n) // b * b), "The last prompt token is always fed"),
        (lambda n, c, b, f, t: _ttft(n, c, b, f, t, min(c, n - 1)), "a cached prefix that ends inside a block"),
        (lambda n, c, b, f, t: _ttft(n, c, b, f, t, min(c, n)), "round the cached prefix down to whole"),
        (lambda n, c, b, f, t: f + t * n, "charge per_token_ms only for the tokens"),
        (lambda n, c, b, f, t: t * (n - min(c, n - 1) // b * b), "add fixed_ms once"),
        (lambda n, c, b, f, t: f + t * (n - c // b * b), "Count the hit tokens"),
        (lambda n, c, b, f, t: "soon", "a time in milliseconds"),
    ],
    ids=["no-token-held-back", "not-whole-blocks", "neither", "cache-ignored", "no-fixed", "other", "not-a-number"],
)
def test_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch07.check_predicted_prefix_ttft(wrong)


def test_refuses_the_courses_model():
    from kvcourse.serving.load import StepCost
    from kvcourse.serving.prefix_ttft import predicted_ttft_s

    with pytest.raises(ExerciseError, match="predicted_ttft_s"):
        ch07.check_predicted_prefix_ttft(
            lambda n, c, b, f, t: 1e3 * predicted_ttft_s(StepCost(f / 1e3, t / 1e3), n, c, b)
        )
