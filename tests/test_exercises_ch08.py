"""Chapter 8's checks accept right answers and reject each typical wrong answer with its own hint.

The wrong answers are written the way a learner would write them, independently of the checks.
"""

from __future__ import annotations

import pytest
import torch

from kvcourse.compression.quantize import fake_quantize
from kvcourse.compression.window import ring_slot
from kvcourse.exercises import ExerciseError, ch08


# ---- 1. a quantizer ------------------------------------------------------------------------------
def quantizer(x, bits):
    lo = x.min(dim=-1, keepdim=True).values
    hi = x.max(dim=-1, keepdim=True).values
    scale = (hi - lo) / (2**bits - 1)
    scale[scale == 0] = 1.0
    q = ((x - lo) / scale).round().clamp(0, 2**bits - 1)
    return q * scale + lo


def quantizer_loops(x, bits):
    out = torch.empty_like(x)
    for idx in range(x.reshape(-1, x.shape[-1]).shape[0]):
        row = x.reshape(-1, x.shape[-1])[idx].tolist()
        lo, hi = min(row), max(row)
        step = (hi - lo) / (2**bits - 1) or 1.0
        out.view(-1, x.shape[-1])[idx] = torch.tensor([lo + round((v - lo) / step) * step for v in row])
    return out


def test_quantizer_accepts_right_answers():
    assert ch08.check_quantizer(quantizer)
    assert ch08.check_quantizer(quantizer_loops, seed=3)


def _levels_pow2(x, bits):
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / 2**bits
    return ((x - lo) / scale).round().clamp(0, 2**bits - 1) * scale + lo


def _floor(x, bits):
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    return torch.floor((x - lo) / scale) * scale + lo


def _global_range(x, bits):
    lo, hi = x.min(), x.max()
    scale = (hi - lo) / (2**bits - 1)
    return ((x - lo) / scale).round() * scale + lo


def _no_zero(x, bits):
    scale = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2**bits - 1)
    return (x / scale).round().clamp(0, 2**bits - 1) * scale


def _symmetric(x, bits):
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(-1, keepdim=True) / qmax
    return (x / scale).round().clamp(-qmax, qmax) * scale


def _codes(x, bits):
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    return ((x - lo) / ((hi - lo) / (2**bits - 1))).round()


def _nan_on_constant(x, bits):
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    return ((x - lo) / scale).round() * scale + lo


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (_levels_pow2, r"2\*\*b - 1 steps"),
        (_floor, "instead of truncating"),
        (_global_range, "One scale and zero point per row"),
        (_no_zero, "Subtract the zero point"),
        (_symmetric, "symmetric quantization"),
        (_codes, "not the codes"),
        (_nan_on_constant, "constant row"),
        (lambda x, bits: x.T, "shape"),
        (lambda x, bits: x * 1.01, r"scale = \(max - min\) / \(2\*\*bits - 1\)"),
    ],
)
def test_quantizer_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch08.check_quantizer(wrong)


def test_quantizer_refuses_the_package_own():
    with pytest.raises(ExerciseError, match="fake_quantize"):
        ch08.check_quantizer(lambda x, bits: fake_quantize(x, f"int{bits}"))


# ---- 2. the ring with sinks ----------------------------------------------------------------------
def slot_for(pos, num_sinks, window):
    if pos < num_sinks:
        return pos
    return num_sinks + (pos - num_sinks) % window


def slot_rotated(pos, num_sinks, window):  # another valid ring: token p still overwrites p - window
    return pos if pos < num_sinks else num_sinks + pos % window


def test_ring_accepts_right_answers(model):
    assert ch08.check_ring_slot(slot_for)
    assert ch08.check_ring_slot(slot_rotated, seed=5)
    assert ch08.check_ring_slot(slot_for, model)


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda p, s, w: p % (s + w), "sinks were overwritten"),
        (lambda p, s, w: p if p < s else p % w, "ring ignores the sinks"),
        (lambda p, s, w: min(p, s + w - 1), "oldest"),
        (lambda p, s, w: s + (p - s) % (w + 1) if p >= s else p, "a slot in 0 .. "),
        (lambda p, s, w: s + (p - s) % max(w - 1, 1) if p >= s else p, "the last `window` positions"),
        (lambda p, s, w: float(slot_for(p, s, w)), "should return an int"),
    ],
)
def test_ring_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch08.check_ring_slot(wrong)


def test_ring_refuses_the_package_own():
    with pytest.raises(ExerciseError, match="ring_slot"):
        ch08.check_ring_slot(ring_slot)
    with pytest.raises(ExerciseError, match="ring_slot"):
        ch08.check_ring_slot(lambda p, s, w: ring_slot(p, s, w))
