"""Chapter 9's checks: the reference answers are right by hand, right answers pass, and each typical mistake,
written independently here, gets its own hint."""

import math
import random

import pytest

from kvcourse.exercises import ExerciseError, ch09
from kvcourse.serving import step_budget

SMOL = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}


# ---- the references, by hand -----------------------------------------------------------------------
def test_step_bytes_reference_by_hand():
    # SmolLM2-135M in bf16: 2 bytes a weight; K and V: 2 * 30 layers * 3 heads * 64 dims * 2 bytes = 23,040 a token
    assert ch09._step_bytes(134_515_008, SMOL, [600] * 64, 2) == 134_515_008 * 2 + 23_040 * 600 * 64
    for case in ch09._bytes_cases(random.Random(1)):  # the package's formula is the check's
        assert step_budget.step_bytes(*case) == ch09._step_bytes(*case)


def test_gpu_floor_and_overlap_references_by_hand():
    assert ch09._gpu_floor(3.35e9, 3.35e12, 100, 2.0) == 1.0  # 1 ms of bytes against 0.2 ms of kernels
    assert ch09._gpu_floor(3.35e8, 3.35e12, 1000, 2.0) == 2.0  # 0.1 ms of bytes against 2 ms of kernels
    assert ch09._overlap(2.5, 1.0, 2.0) == (2.0, 1.25)
    for step, host, gpu in ch09._overlap_cases(random.Random(2)):
        bound = step_budget.overlap_bound(step, host, gpu)
        assert (bound["best_ms"], bound["speedup"]) == ch09._overlap(step, host, gpu)


# ---- right answers pass --------------------------------------------------------------------------
def my_step_bytes(num_parameters, config, seq_lens, dtype_bytes):
    layers, heads, dim = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
    return dtype_bytes * (num_parameters + 2 * layers * heads * dim * sum(seq_lens))


def my_floor(step_bytes, bandwidth, kernels, kernel_us):
    return max(step_bytes / bandwidth * 1000, kernels * kernel_us / 1000)


def my_overlap(step_ms, host_ms, gpu_ms):
    best = host_ms if host_ms > gpu_ms else gpu_ms
    return best, step_ms / best


@pytest.mark.parametrize("seed", [0, 1, 5])
def test_right_answers_pass(seed):
    assert ch09.check_step_bytes(my_step_bytes, seed=seed)
    assert ch09.check_gpu_floor(my_floor, seed=seed)
    assert ch09.check_overlap_gain(my_overlap, seed=seed)


# ---- wrong answers get their hint ----------------------------------------------------------------
def _kv(config, heads_key="num_key_value_heads"):
    return config["num_hidden_layers"] * config[heads_key] * config["head_dim"]


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda p, c, lens, b: b * (p + _kv(c) * sum(lens)), "two tensors per layer"),
        (lambda p, c, lens, b: b * (p + 2 * _kv(c, "num_attention_heads") * sum(lens)), "not num_attention_heads"),
        (lambda p, c, lens, b: b * (p * len(lens) + 2 * _kv(c) * sum(lens)), "the weights count once"),
        (lambda p, c, lens, b: b * 2 * _kv(c) * sum(lens), "The weights are read every step"),
        (
            lambda p, c, lens, b: b * (p + 2 * c["num_key_value_heads"] * c["head_dim"] * sum(lens)),
            "multiply by num_hidden_layers",
        ),
        (lambda p, c, lens, b: b * p + 2 * _kv(c) * sum(lens), "Count bytes, not elements"),
        (lambda p, c, lens, b: 0, "A decode step reads"),
    ],
)
def test_step_bytes_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch09.check_step_bytes(wrong)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda n, bw, k, us: n / bw * 1e3 + k * us * 1e-3, "not their sum"),
        (lambda n, bw, k, us: min(n / bw * 1e3, k * us * 1e-3), "not the smaller"),
        (lambda n, bw, k, us: max(n / bw, k * us), "Milliseconds"),
        (lambda n, bw, k, us: max(n / bw * 1e3, k * us * 1e-6), "The kernels set a floor too"),
        (lambda n, bw, k, us: n / bw * 1e3, "The kernels set a floor too"),
        (lambda n, bw, k, us: 1.0, "the floor is the larger of the two"),
    ],
)
def test_gpu_floor_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch09.check_gpu_floor(wrong)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda s, h, g: (min(h, g), s / min(h, g)), "not the shorter"),
        (lambda s, h, g: (abs(h - g), s / abs(h - g)) if h != g else (0.0, math.inf), "their difference"),
        (lambda s, h, g: (max(h, g), max(h, g) / s), "The speed-up is the old step"),
        (lambda s, h, g: (s - h, s / (s - h)), "not step_ms - host_ms"),
        (lambda s, h, g: (s, 1.0), "a step takes max"),
    ],
)
def test_overlap_gain_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch09.check_overlap_gain(wrong)


def test_the_package_is_refused_as_an_answer():
    with pytest.raises(ExerciseError, match="kvcourse's own"):
        ch09.check_step_bytes(step_budget.step_bytes)
    with pytest.raises(ExerciseError, match="kvcourse"):
        ch09.check_gpu_floor(lambda n, bw, k, us: max(step_budget.bytes_floor_ms(n, bw), k * us / 1e3))
    with pytest.raises(ExerciseError, match="kvcourse's own"):
        ch09.check_overlap_gain(step_budget.overlap_bound)


def test_a_wrong_type_is_named():
    with pytest.raises(ExerciseError, match="should return milliseconds"):
        ch09.check_gpu_floor(lambda *a: "1 ms")
    with pytest.raises(ExerciseError, match=r"should return \(best_ms, speedup\)"):
        ch09.check_overlap_gain(lambda *a: 1.0)
    assert math.isfinite(ch09._gpu_floor(1, 1, 1, 1))
