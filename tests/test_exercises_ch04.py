"""Chapter 4's checks accept the right answers and reject wrong ones with a hint."""

import pytest

from kvcourse.exercises import ExerciseError, ch04
from kvcourse.fragmentation import block_size_sweep, make_trace


def test_blocks_needed_accepts_right_answer():
    assert ch04.check_blocks_needed(lambda n, b: -(-n // b))


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda n, b: n // b, "round up"),
        (lambda n, b: n // b + 1, "exactly fills"),
        (lambda n, b: float(-(-n // b)), "int"),
        (lambda n, b: 1 / 0, "ZeroDivisionError"),
        ("3", "function"),
    ],
)
def test_blocks_needed_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_blocks_needed(wrong)


def test_slot_for_accepts_right_answer():
    assert ch04.check_slot_for(lambda table, pos, b: table[pos // b] * b + pos % b)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda table, pos, b: pos, "contiguous cache"),
        (lambda table, pos, b: table[pos // b] + pos % b, "multiply"),
        (lambda table, pos, b: table[pos % len(table)] * b + pos % b, "Logical block"),
    ],
)
def test_slot_for_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_slot_for(wrong)


def right_sharing(p, n, new, b):
    return p // b + n * (-(-(p + new) // b) - p // b)


def test_parallel_sampling_accepts_right_answer():
    assert ch04.check_parallel_sampling_blocks(right_sharing)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda p, n, new, b: n * -(-(p + new) // b), "stored once"),
        # shares the partial prompt block too, forgetting copy-on-write
        (lambda p, n, new, b: -(-p // b) + n * (-(-(p + new) // b) - -(-p // b)), "copy-on-write"),
        # copies the partial block for every sample, including the last owner
        (lambda p, n, new, b: right_sharing(p, n, new, b) + (1 if p % b else 0), "Count the shared"),
    ],
)
def test_parallel_sampling_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_parallel_sampling_blocks(wrong)


def test_reference_matches_closed_form_on_a_grid():
    for p in (1, 15, 16, 17, 40):
        for n in (1, 2, 5):
            for new in (1, 3, 16, 33):
                assert ch04.parallel_sampling_blocks(p, n, new, 16) == right_sharing(p, n, new, 16)
    with pytest.raises(ValueError, match="n must"):
        ch04.parallel_sampling_blocks(10, 0, 5, 16)


def test_largest_block_size():
    # From the sweep of make_trace(300, seed=0) in 16,384 slots: 64 keeps 92.2% live, 128 only 86.4%.
    sweep = {r.block_size: r.live_frac for r in block_size_sweep(make_trace(300, seed=0), 16384)}
    assert sweep[64] >= 0.9 > sweep[128]
    want = 64
    assert ch04.largest_block_size(0.9) == want
    assert ch04.check_largest_block_size(want)
    with pytest.raises(ExerciseError, match="too big"):
        ch04.check_largest_block_size(want * 2)
    with pytest.raises(ExerciseError, match="larger one"):
        ch04.check_largest_block_size(want // 2)
    with pytest.raises(ExerciseError, match="swept"):
        ch04.check_largest_block_size(48)
    with pytest.raises(ExerciseError, match="int"):
        ch04.check_largest_block_size("64")
