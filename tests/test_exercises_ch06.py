"""Chapter 6's checks: the references agree with the scheduler, right answers pass, typical mistakes get their hint."""

from __future__ import annotations

import math
import random

import pytest

from kvcourse.exercises import ExerciseError, ch06
from kvcourse.serving import preempt_newest


# ---- the references -----------------------------------------------------------------------------
def test_victims_reference_is_the_schedulers_default_and_the_cases_preempt():
    """The reference policy is the package's default (the newest); every hidden workload preempts, and the first
    case tells the newest, the one asking and the least work apart."""
    for case in ch06._victim_cases(random.Random(1)):
        assert ch06._preemptions(case, ch06._pick_victim) == ch06._preemptions(case, preempt_newest)
        assert ch06._preemptions(case, None)[0]
    first = ch06._victim_cases(random.Random(1))[0]
    runs = {ch06._run(first, ch06._learner_policy(f)) for f in (right_pick, lambda c: c[0], least_work)}
    assert len(runs) == 3


def test_a_recompute_count_is_what_the_engine_log_shows():
    # X (prompt 2) and Y (prompt 6), blocks of 2, 5 blocks, 4 new tokens each. Step 0: X takes 1 block, Y 3.
    # Step 1: X takes the last free block for position 2; Y needs a fourth for position 6 and, the newest,
    # preempts itself. Re-admitted, it recomputes the 6 tokens whose K/V it had (its first output never had any).
    log, recomputed = ch06._preemptions(((2, 6), 4, 5, 2, 64), None)
    assert log == [(1, 1)] and recomputed == 6


def test_chunk_size_reference():
    assert ch06._chunk_size(40.0, 0.25, 8, 100.0) == 232  # (100 - 40) / 0.25 = 240 tokens, 8 are decodes
    assert ch06._chunk_size(40.0, 0.5, 100, 60.0) == 0  # the decodes alone take 90 ms
    for args in ch06._chunk_cases(random.Random(3)):
        c = ch06._chunk_size(*args)
        fixed, per, decodes, tpot = args
        if c:
            assert fixed + per * (decodes + c) <= tpot < fixed + per * (decodes + c + 1)


# ---- right answers pass --------------------------------------------------------------------------
def right_pick(candidates):
    return candidates[len(candidates) - 1]


def longest(candidates):
    return max(candidates, key=lambda s: s["num_tokens"])


def least_work(candidates):
    best = candidates[0]
    for s in candidates[1:]:
        if s["num_computed_tokens"] <= best["num_computed_tokens"]:  # ties: the newer one
            best = s
    return best


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_right_answers_pass(seed):
    assert ch06.check_chunk_size(lambda f, p, d, t: max(0, math.floor((t - f) / p) - d), seed=seed)


@pytest.mark.parametrize("seed", [0, 3])
def test_the_newest_first_policy_passes_in_the_engine_on_the_real_model(model_on, seed):
    assert ch06.check_victims(right_pick, model_on, seed=seed)


# ---- wrong answers get their hint ----------------------------------------------------------------
def shortest_prompt(candidates):
    return sorted(candidates, key=lambda s: s["num_tokens"])[0]


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda c: c[0], r"candidates\[0\] is the request that asks for the block"),
        (lambda c: min(c, key=lambda s: s["seq_id"]), "it starves"),  # the oldest, by id
        (longest, "Choosing by length"),
        (lambda c: sorted(c, key=lambda s: s["num_tokens"])[-1], "Choosing by length"),  # ties: the newest
        (least_work, "the least work, is not the rule"),
        (shortest_prompt, "Choosing the shortest"),
        (lambda c: c[1] if len(c) > 1 else c[0], "the last of the candidates"),
        (lambda c: c[-1]["seq_id"], "the dict itself, not its seq_id"),
        (lambda c: len(c) - 1, "return one of the candidates"),
        (lambda c: c[5], "raised IndexError"),
        (3, "pass your function"),
        (preempt_newest, "kvcourse's own preempt_newest"),
    ],
)
def test_victims_reject_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch06.check_victims(wrong)  # they fail on the traces, before the model is loaded


def test_a_policy_that_never_lets_the_workload_finish_is_stopped(monkeypatch):
    monkeypatch.setattr(ch06, "_MAX_STEPS", 3)
    with pytest.raises(ExerciseError, match="did not finish in 3 steps"):
        ch06.check_victims(right_pick)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda f, p, d, t: max(0, math.floor((t - f) / p)), "decode tokens share the step"),
        (lambda f, p, d, t: max(0, math.ceil((t - f) / p) - d), "Round down"),
        (lambda f, p, d, t: math.floor((t - f) / p) - d, "return 0"),
        (lambda f, p, d, t: float(max(0, math.floor((t - f) / p) - d)), "int number of tokens"),
        (lambda f, p, d, t: max(0, int(t // (f + p)) - d), "once per step"),
        (lambda f, p, d, t: 0, "Solve"),
    ],
)
def test_chunk_size_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch06.check_chunk_size(wrong)


# ---- predict first: a long prompt's first token ---------------------------------------------------
def right_predict(prompt_len, num_decodes, budget, fixed_ms, per_token_ms):
    chunk = budget - num_decodes
    steps = math.ceil(prompt_len / chunk)
    return steps, steps * fixed_ms + per_token_ms * (prompt_len + steps * num_decodes)


def test_predicted_ttft_reference_by_hand():
    # The chapter's run: 1,024 tokens beside 4 decodes, budget 128: chunks of 124, nine steps, 1,060 tokens fed.
    assert ch06._predicted_ttft(1024, 4, 128, 56.0, 1.45) == (9, 9 * 56.0 + 1.45 * 1060)
    assert ch06._predicted_ttft(1024, 4, 2048, 56.0, 1.45) == (1, 56.0 + 1.45 * 1028)  # the whole prompt at once
    for case in ch06._predict_cases(random.Random(5)):  # the scheduler's count is the closed form's
        steps, ms = ch06._predicted_ttft(*case)
        assert steps == right_predict(*case)[0] and math.isclose(ms, right_predict(*case)[1])


@pytest.mark.parametrize("seed", [0, 4])
def test_a_right_prediction_passes(seed):
    assert ch06.check_predicted_ttft(right_predict, seed=seed)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda p, d, b, f, t: (math.ceil(p / b), math.ceil(p / b) * (f + t * d) + t * p), "The decodes go first"),
        (
            lambda p, d, b, f, t: (right_predict(p, d, b, f, t)[0], right_predict(p, d, b, f, t)[0] * f + t * p),
            "The decodes share every step",
        ),
        (
            lambda p, d, b, f, t: (right_predict(p, d, b, f, t)[0], f + t * (p + right_predict(p, d, b, f, t)[0] * d)),
            "Every step pays the fixed cost",
        ),
        (lambda p, d, b, f, t: (max(1, p // (b - d)), max(1, p // (b - d)) * (f + t * d) + t * p), "A partial chunk"),
        (
            lambda p, d, b, f, t: (right_predict(p, d, b, f, t)[0], right_predict(p, d, b, f, t)[0] * (f + t * b)),
            "The last chunk is usually smaller",
        ),
        (lambda p, d, b, f, t: 2.0, "should return \\(steps, milliseconds\\)"),
    ],
)
def test_wrong_predictions_get_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch06.check_predicted_ttft(wrong)


def test_running_a_scheduler_is_not_a_prediction():
    def predict_ttft(p, d, b, f, t):
        from kvcourse.serving import Scheduler

        return Scheduler, 0.0

    with pytest.raises(ExerciseError, match="Scheduler"):
        ch06.check_predicted_ttft(predict_ttft)
