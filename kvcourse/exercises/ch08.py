"""Checks for chapter 8, *Compressing the cache*.

1. :func:`check_quantizer` -- asymmetric integer quantization of each row, and back.
2. :func:`check_ring_slot` -- where a sliding-window cache with attention sinks writes each token
   (optionally driving the real model through a ring buffer built on the learner's answer).

Each check runs the learner's code on hidden random cases (seeded from the check's ``seed``
argument) and raises :class:`~kvcourse.exercises.ExerciseError` with the case, the expected and
returned values and a hint on the first wrong one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..compression import window as _window
from ..compression.quantize import fake_quantize
from ._core import (
    call_learner,
    case_generator,
    case_rng,
    CheckResult,
    describe,
    Diagnosis,
    ExerciseError,
    expect_tensor,
    fail,
    passed,
    refuse_references,
    tensor_diff,
    wrap_checks,
)

__all__ = ["check_quantizer", "check_ring_slot"]


# --- Exercise 1: a quantizer ---------------------------------------------------------------------

def _fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The right answer: per-row min-max quantization to ``bits``-bit codes, then back (fp32 scale)."""
    levels = 2**bits - 1
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round((x - lo) / safe), 0, levels) * scale + lo


def _with_levels(x: torch.Tensor, bits: int, steps: int, round_fn=torch.round, per_row: bool = True) -> torch.Tensor:
    lo = x.amin(-1, keepdim=True) if per_row else x.min().expand(*x.shape[:-1], 1)
    hi = x.amax(-1, keepdim=True) if per_row else x.max().expand(*x.shape[:-1], 1)
    scale = (hi - lo) / steps
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(round_fn((x - lo) / safe), 0, 2**bits - 1) * scale + lo


def _no_zero_point(x: torch.Tensor, bits: int) -> torch.Tensor:
    levels = 2**bits - 1
    scale = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / levels
    return torch.clamp(torch.round(x / scale), 0, levels) * scale


def _symmetric(x: torch.Tensor, bits: int) -> torch.Tensor:
    top = 2 ** (bits - 1) - 1
    scale = x.abs().amax(-1, keepdim=True) / top
    return torch.clamp(torch.round(x / scale), -top, top) * scale


def _codes_only(x: torch.Tensor, bits: int) -> torch.Tensor:
    levels = 2**bits - 1
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    return torch.round((x - lo) / ((hi - lo) / levels))


_QUANT_MISTAKES = [
    ("With b bits the codes run from 0 to 2**b - 1: that is 2**b - 1 steps from the row's minimum to its maximum, "
     "so scale = (max - min) / (2**b - 1). Dividing by 2**b leaves the largest value short.",
     lambda x, bits: _with_levels(x, bits, 2**bits)),
    ("Round to the nearest code (torch.round) instead of truncating: truncation doubles the worst error and pulls "
     "every value down.", lambda x, bits: _with_levels(x, bits, 2**bits - 1, torch.floor)),
    ("One scale and zero point per row: take the minimum and maximum along the last axis (keepdim=True), not over "
     "the whole tensor.", lambda x, bits: _with_levels(x, bits, 2**bits - 1, per_row=False)),
    ("Subtract the zero point (the row's minimum) before dividing by the scale, and add it back after: otherwise "
     "the negative values fall below code 0.", _no_zero_point),
    ("That is symmetric quantization (codes around 0, scale from the largest |x|). Here the codes are unsigned, "
     "0 .. 2**b - 1, with the row's minimum as zero point.", _symmetric),
    ("Return the values the codes stand for (code * scale + zero point), not the codes.", _codes_only),
]


def _same_codes(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, bits: int) -> bool:
    """Equal up to float noise; a value halfway between two codes may round either way."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo) / (2**bits - 1)
    diff = (got - want).abs()
    close = diff <= 1e-4 * step + 1e-6
    t = (x - lo) / torch.where(step > 0, step, torch.ones_like(step))
    tie = ((t - t.floor()) - 0.5).abs() < 1e-3
    return bool((close | (tie & (diff <= step * 1.001))).all())


def check_quantizer(fn: Callable[[torch.Tensor, int], torch.Tensor], seed: int = 0) -> CheckResult:
    """``fn(x, bits)`` -> the values ``x`` comes back as after ``bits``-bit asymmetric quantization of each row.

    Every row (the last axis) is one group: zero point = the row's minimum, scale = its range over
    ``2**bits - 1`` steps, codes rounded to the nearest integer in ``0 .. 2**bits - 1``.
    """
    if not callable(fn):
        raise ExerciseError(f"pass your function fn(x, bits), got {type(fn).__name__}")
    refuse_references(fn, {"fake_quantize": fake_quantize}, "write the quantizer yourself.")
    rng = case_rng("ch08.check_quantizer", seed)
    gen = case_generator("ch08.check_quantizer", seed)
    cases = []
    for bits in (8, 4, 2, 3, 8, 4):
        shape = rng.choice([(4, 16), (3, 8), (2, 3, 32)])
        x = torch.randn(*shape, generator=gen) * rng.uniform(0.5, 4) + rng.uniform(-1, 1)
        if rng.random() < 0.5:
            x[..., rng.randrange(shape[-1])] *= 8  # an outlier in some rows
        cases.append((x, bits))
    diagnosis = Diagnosis(_QUANT_MISTAKES, "Per row: scale = (max - min) / (2**bits - 1), code = round((x - min) / "
                          "scale), value = code * scale + min.",
                          lambda got, wrong: torch.allclose(got.float(), wrong.float(), rtol=1e-4, atol=1e-4))  # fmt: skip
    for x, bits in cases:
        case = f"quantize-dequantize({describe(x)}, bits={bits})"
        got = call_learner("your quantizer", fn, x.clone(), bits)
        expect_tensor(case, got, tuple(x.shape), what="(the shape of x)")
        want = _fake_quant(x, bits)
        if not _same_codes(got.float(), want, x, bits):
            diagnosis.record(case, (x, bits), got, want, extra=f" ({tensor_diff(got, want)})")
    diagnosis.raise_if_wrong()
    # A row whose values are all equal has no range: every code is 0 and the row comes back exactly.
    flat = torch.full((2, 8), 1.5)
    got = call_learner("your quantizer", fn, flat.clone(), 4)
    if not isinstance(got, torch.Tensor) or not torch.equal(got.float(), flat):
        fail("quantize-dequantize of a constant row [1.5, 1.5, ...], bits=4", expected=flat, got=got,
             hint="max - min is 0 for a constant row: guard the division (any nonzero scale works there, "
                  "every code is 0 and the row comes back as its minimum).")  # fmt: skip
    return passed("every value comes back within half a step (scale / 2) of itself, and the step is the row's "
                  "range over 2**bits - 1.")  # fmt: skip


# --- Exercise 2: the ring buffer with attention sinks ---------------------------------------------

def _held(slot_for: Callable[[int, int, int], int], num_tokens: int, num_sinks: int, window: int) -> list[int]:
    slots = [-1] * (num_sinks + window)
    for pos in range(num_tokens):
        slots[slot_for(pos, num_sinks, window)] = pos
    return slots


def _expected_held(num_tokens: int, num_sinks: int, window: int) -> list[int]:
    return sorted(set(range(min(num_sinks, num_tokens))) | set(range(max(num_tokens - window, 0), num_tokens)))


_RING_MISTAKES = [
    ("The sinks were overwritten: the ring turns over the window's slots only. Positions below num_sinks keep "
     "their slots for good.", lambda p, s, w: p % (s + w)),
    ("The ring ignores the sinks: slot p % window lands on a sink's slot. The ring's slots come after the sinks.",
     lambda p, s, w: p % w if p >= s else p),
    ("Once the cache is full, a ring buffer overwrites its *oldest* token (the one window positions back), not "
     "its newest.", lambda p, s, w: min(p, s + w - 1)),
]


def check_ring_slot(slot_for: Callable[[int, int, int], int], model=None, seed: int = 0) -> CheckResult:
    """``slot_for(pos, num_sinks, window)`` -> the slot, in ``0 .. num_sinks + window - 1``, where the token at
    position ``pos`` is written, so that after tokens ``0 .. n-1`` are written in order the cache holds the first
    ``num_sinks`` and the last ``window`` of them. With ``model``, the check also decodes text through a ring
    buffer that uses your slots, and compares the logits with the exact sliding-window attention.
    """
    if not callable(slot_for):
        raise ExerciseError(f"pass your function slot_for(pos, num_sinks, window), got {type(slot_for).__name__}")
    refuse_references(slot_for, {"ring_slot": _window.ring_slot, "SinkKVCache": _window.SinkKVCache},
                      "write the slot formula yourself.")  # fmt: skip
    rng = case_rng("ch08.check_ring_slot", seed)
    pairs = [(4, 4), (0, 3), (1, 1), (2, 5)] + [(rng.randint(0, 4), rng.randint(1, 6)) for _ in range(6)]
    diagnosis = Diagnosis([(hint, (lambda m: lambda n, s, w: sorted(p for p in _held(m, n, s, w) if p >= 0))(m))
                           for hint, m in _RING_MISTAKES],
                          "After writing tokens 0 .. n-1 in order, the slots must hold positions 0 .. num_sinks-1 and "
                          "the last `window` positions.", lambda got, wrong: got == wrong)  # fmt: skip
    for num_sinks, window in pairs:
        size = num_sinks + window
        slots = [-1] * size
        for pos in range(num_sinks + 3 * window + 1):
            slot = call_learner("slot_for", slot_for, pos, num_sinks, window)
            case = f"slot_for({pos}, num_sinks={num_sinks}, window={window})"
            if isinstance(slot, bool) or not isinstance(slot, int):
                raise ExerciseError(f"{case} should return an int, got {type(slot).__name__}", case=case)
            if not 0 <= slot < size:
                fail(case, expected=f"a slot in 0 .. {size - 1}", got=slot,
                     hint="The cache has num_sinks + window slots; a ring wraps around with % window.")  # fmt: skip
            slots[slot] = pos
            got = sorted(p for p in slots if p >= 0)
            want = _expected_held(pos + 1, num_sinks, window)
            if got != want:
                diagnosis.record(f"after writing positions 0 .. {pos} with num_sinks={num_sinks}, window={window}, "
                                 f"the positions held", (pos + 1, num_sinks, window), got, want)  # fmt: skip
                break
    diagnosis.raise_if_wrong()
    if model is not None:
        _ring_on_the_model(slot_for, model)
    return passed("each token overwrites the one `window` positions before it, and the sinks stay: memory is "
                  "bounded at num_sinks + window tokens.")  # fmt: skip


def _ring_on_the_model(slot_for: Callable[[int, int, int], int], model) -> None:
    class LearnerRing(_window.SinkKVCache):
        def slots(self, positions: torch.Tensor) -> torch.Tensor:
            return torch.tensor([slot_for(int(p), self.num_sinks, self.window) for p in positions], dtype=torch.int64)

    ids = [1, 504, 3458, 282, 4649, 314, 17, 30, 2045, 1099, 28, 253, 1183, 314, 16, 4, 2116, 18]
    num_sinks, window = 2, 5
    cache = LearnerRing.for_model(model.config, window=window, num_sinks=num_sinks)
    got = torch.cat([model(torch.tensor([[i]], device=model.device), cache=cache)[0] for i in ids]).float()
    want = _window.simulate_window_logits(model, ids, window, num_sinks)
    scale = float(want.abs().max())
    if not torch.allclose(got, want, rtol=0, atol=1e-4 * scale):
        fail(f"decoding {len(ids)} tokens on the real model through your ring (num_sinks={num_sinks}, "
             f"window={window})", expected="the logits of exact sliding-window attention with sinks",
             got=tensor_diff(got, want), hint="The positions held look right; check the slot is an int for every "
             "position and that nothing else writes into the sinks.")  # fmt: skip


wrap_checks(globals())  # an unwritten answer is reported ("Not done yet"), not raised: see _core.reports_unfinished
