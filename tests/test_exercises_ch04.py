"""Chapter 4's checks accept right answers and reject each typical wrong answer with its own hint.

The wrong answers are written the way a learner would write them, independently of the checks.
"""

from __future__ import annotations

import math

import pytest

from kvcourse.exercises import ExerciseError, ch04
from kvcourse.fragmentation import block_size_sweep, make_trace
from kvcourse.paged import BlockManager, slot_mapping


# ---- 1. the slot mapping of a step ---------------------------------------------------------------
def step_slots(block_tables, seq_lens, query_lens, block_size):
    slots = []
    for table, seq_len, q in zip(block_tables, seq_lens, query_lens):
        for pos in range(seq_len - q, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots


def test_slot_mapping_accepts_right_answers(capsys):
    assert ch04.check_slot_mapping(step_slots)
    assert "Correct" in capsys.readouterr().out
    assert ch04.check_slot_mapping(step_slots, seed=7)
    import torch  # a tensor answer is fine too

    assert ch04.check_slot_mapping(lambda *a: torch.tensor(step_slots(*a)))


def test_slot_mapping_agrees_with_the_package():
    tables, lens, q = [[3, 0, 2], [5], [1, 4]], [17, 4, 9], [1, 4, 3]
    want = sum((slot_mapping(t, range(n - k, n), 8) for t, n, k in zip(tables, lens, q)), [])
    assert step_slots(tables, lens, q, 8) == want


def _positions(seq_len, q, start_of):
    return range(start_of(seq_len, q), start_of(seq_len, q) + q)


def _mapping(start_of=lambda n, q: n - q, slot=lambda t, pos, b: t[pos // b] * b + pos % b, table_of=None):
    def fn(tables, lens, qs, b):
        out = []
        for i, (t, n, q) in enumerate(zip(tables, lens, qs)):
            t = tables[0] if table_of == "first" else t
            out += [slot(t, pos, b) for pos in _positions(n, q, start_of)]
        return out

    return fn


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (_mapping(start_of=lambda n, q: 0), "not from 0"),
        (_mapping(start_of=lambda n, q: n), "length AFTER this step"),
        (_mapping(start_of=lambda n, q: n - q + 1), "a prefill starts at 0"),
        (_mapping(slot=lambda t, pos, b: pos), "contiguous cache"),
        (_mapping(slot=lambda t, pos, b: t[pos // b] + pos % b), "multiply it by block_size"),
        (_mapping(slot=lambda t, pos, b: t[pos // b] * b), "offset inside the block"),
        (_mapping(table_of="first"), "its own block table"),
        # every cached token too, not only the new ones
        (
            lambda tables, lens, qs, b: [t[p // b] * b + p % b for t, n in zip(tables, lens) for p in range(n)],
            "One slot per NEW token",
        ),
        (lambda tables, lens, qs, b: "slots", "list of ints"),
        (lambda tables, lens, qs, b: [s + 1 for s in step_slots(tables, lens, qs, b)], "Position pos of sequence b"),
    ],
)
def test_slot_mapping_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_slot_mapping(wrong)


def test_slot_mapping_refuses_the_package():
    with pytest.raises(ExerciseError, match="calls kvcourse's slot_mapping"):
        ch04.check_slot_mapping(
            lambda tables, lens, qs, b: sum(
                (slot_mapping(t, range(n - q, n), b) for t, n, q in zip(tables, lens, qs)), []
            )
        )


# ---- 2. the block allocator (bug hunt) -----------------------------------------------------------
class Allocator:
    """A right allocator, written for this test: reference counts in a dict, free blocks in a list."""

    def __init__(self, num_blocks, block_size):
        self.size = block_size
        self.free_list = list(range(num_blocks))
        self.refs = {}
        self.tables = {}
        self.lengths = {}

    @property
    def num_free_blocks(self):
        return len(self.free_list)

    def block_table(self, seq):
        return self.tables[seq]

    def new_block(self):
        block = self.free_list.pop()
        self.refs[block] = 1
        return block

    def blocks_for(self, n):
        return math.ceil(n / self.size)

    def allocate(self, seq, n):
        self.tables[seq] = [self.new_block() for _ in range(self.blocks_for(n))]
        self.lengths[seq] = n

    def needs_new_block(self, n):
        return n % self.size == 0

    def should_copy(self, table, n):
        return n % self.size != 0 and self.refs[table[-1]] > 1

    def release(self, block):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_list.append(block)

    def append_slot(self, seq):
        table, n = self.tables[seq], self.lengths[seq]
        result = None
        if self.should_copy(table, n):
            old = table[-1]
            table[-1] = self.new_block()
            self.release(old)
            result = (old, table[-1])
        elif self.needs_new_block(n):
            table.append(self.new_block())
        self.lengths[seq] = n + 1
        return result

    def fork(self, parent, child):
        for block in self.tables[parent]:
            self.refs[block] += 1
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]

    def free(self, seq):
        for block in self.tables.pop(seq):
            self.release(block)
        del self.lengths[seq]


def test_block_manager_accepts_a_right_allocator(capsys):
    for seed in range(4):
        assert ch04.check_block_manager(Allocator, seed=seed)
    assert "Correct" in capsys.readouterr().out


class AllocatesOneTooMany(Allocator):
    def blocks_for(self, n):
        return n // self.size + 1


class NewBlockEarly(Allocator):
    def needs_new_block(self, n):
        return (n + 1) % self.size == 0


class NeverCopies(Allocator):
    def should_copy(self, table, n):
        return False


class CopiesFullBlocks(Allocator):
    def should_copy(self, table, n):
        return bool(table) and self.refs[table[-1]] > 1

    def append_slot(self, seq):
        table, n = self.tables[seq], self.lengths[seq]
        result = super().append_slot(seq)
        if result is not None and n % self.size == 0:  # copied a full block, still needs a new one
            table.append(self.new_block())
        return result


class CopyKeepsItsReference(Allocator):
    """Copy-on-write without letting go of the source block (the bug of the chapter's bug hunt)."""

    def append_slot(self, seq):
        table, n = self.tables[seq], self.lengths[seq]
        if self.should_copy(table, n):
            old = table[-1]
            table[-1] = self.new_block()  # but refs[old] is not decremented
            self.lengths[seq] = n + 1
            return (old, table[-1])
        return super().append_slot(seq)


class FreeIgnoresReferences(Allocator):
    def free(self, seq):
        for block in self.tables.pop(seq):
            self.refs[block] = 0
            self.free_list.append(block)
        del self.lengths[seq]


class ForkWithoutReferences(Allocator):
    def fork(self, parent, child):
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]


class FreeForgetsSharedBlocks(Allocator):
    def free(self, seq):
        for block in self.tables.pop(seq):
            if self.refs[block] == 1:  # shared blocks are skipped, never decremented
                self.release(block)
        del self.lengths[seq]


class ChecksBeforeDecrement(Allocator):
    def free(self, seq):
        for block in self.tables.pop(seq):
            if self.refs[block] == 0:  # checked one step too early: never true for a held block
                self.free_list.append(block)
            self.refs[block] -= 1
        del self.lengths[seq]


class CopyNotInTable(Allocator):
    def append_slot(self, seq):
        table, n = self.tables[seq], self.lengths[seq]
        if self.should_copy(table, n):
            old, new = table[-1], self.new_block()
            self.release(old)
            self.lengths[seq] = n + 1
            self.tables[seq] = table  # forgot table[-1] = new
            return (old, new)
        return super().append_slot(seq)


@pytest.mark.parametrize(
    ("cls", "hint"),
    [
        (AllocatesOneTooMany, "ceil\\(num_tokens / block_size\\) blocks"),
        (NewBlockEarly, "exactly when the last one is full"),
        (NeverCopies, "copy it first"),
        (CopiesFullBlocks, "never written again"),
        (CopyKeepsItsReference, "only owner now"),
        (FreeIgnoresReferences, "reference count drops to 0"),
        (ForkWithoutReferences, "reference count drops to 0"),
        (FreeForgetsSharedBlocks, "only owner now"),
        (ChecksBeforeDecrement, "a leak"),
        (CopyNotInTable, "point at the copy"),
    ],
)
def test_block_manager_rejects_wrong_allocators_with_their_hint(cls, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_block_manager(cls)


def test_block_manager_refuses_the_package():
    with pytest.raises(ExerciseError, match="inherits"):
        ch04.check_block_manager(type("Sub", (BlockManager,), {}))

    class Wrapper:
        def __init__(self, n, b):
            self.bm = BlockManager(n, b)

    with pytest.raises(ExerciseError, match="calls kvcourse's BlockManager"):
        ch04.check_block_manager(Wrapper)
    with pytest.raises(ExerciseError, match="class itself"):
        ch04.check_block_manager(Allocator(4, 4))


# ---- 3. memory of n samples ----------------------------------------------------------------------
def right_sharing(p, n, new, b):
    full_prompt_blocks = p // b
    own = math.ceil((p + new) / b) - full_prompt_blocks
    return full_prompt_blocks + n * own


def test_parallel_sampling_accepts_right_answer():
    assert ch04.check_parallel_sampling_blocks(right_sharing)
    assert ch04.check_parallel_sampling_blocks(right_sharing, seed=11)


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda p, n, new, b: n * math.ceil((p + new) / b), "stored once"),
        # shares the partial prompt block too, forgetting copy-on-write
        (lambda p, n, new, b: math.ceil(p / b) + n * (math.ceil((p + new) / b) - math.ceil(p / b)), "FULL prompt"),
        # copies the partial block for every sample, including the last owner
        (lambda p, n, new, b: right_sharing(p, n, new, b) + (1 if p % b else 0), "n - 1 copies"),
        (lambda p, n, new, b: p // b + n * ((p + new) // b - p // b), "round up"),
        (lambda p, n, new, b: p // b + (n - 1) * (math.ceil((p + new) / b) - p // b), "All n sequences"),
        (lambda p, n, new, b: right_sharing(p, n, new, b) + 2, "Count the full prompt blocks once"),
        (lambda p, n, new, b: float(right_sharing(p, n, new, b)), "should return an int"),
    ],
)
def test_parallel_sampling_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_parallel_sampling_blocks(wrong)


def test_sharing_reference_matches_the_closed_form_on_a_grid():
    for p in (1, 15, 16, 17, 40):
        for n in (1, 2, 5):
            for new in (1, 3, 16, 33):
                assert ch04._sharing_blocks(p, n, new, 16) == right_sharing(p, n, new, 16)


# ---- 4. the live fraction of a block size ------------------------------------------------------------
def right_live_fraction(lengths, block_size):
    return sum(lengths) / sum(-(-n // block_size) * block_size for n in lengths)


def test_live_fraction_accepts_the_right_answer_written_two_ways():
    assert ch04.check_live_fraction(right_live_fraction)
    assert ch04.check_live_fraction(lambda ls, b: 1 - sum((-n) % b for n in ls) / sum(-(-n // b) * b for n in ls))


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda ls, b: sum(ls) / sum(max(1, n // b) * b for n in ls), "round the blocks up"),
        (lambda ls, b: 1 - right_live_fraction(ls, b), "empty share"),
        (lambda ls, b: sum(n / (-(-n // b) * b) for n in ls) / len(ls), "all tokens over all slots"),
        (lambda ls, b: sum(ls) / sum(n + (b - 1) / 2 for n in ls), "count each sequence's own last block"),
        (lambda ls, b: 0.9, "whole blocks, enough for its tokens"),
        (lambda ls, b: "0.9", "should return a number"),
    ],
)
def test_live_fraction_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_live_fraction(wrong)


def test_the_static_live_fraction_moves_down_for_shorter_requests():
    # What the exercise asks the learner to find with their function (the chapter's solution asserts it too).
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    long = [r.total_len for r in make_trace(300, seed=0)]
    short = [r.total_len for r in make_trace(300, seed=0, prompt_median=20, output_median=60)]
    best = [max(b for b in sizes if right_live_fraction(ls, b) >= 0.9) for ls in (long, short)]
    assert best == [64, 16]


def test_no_reference_answers_are_public():
    for name in dir(ch04):
        obj = getattr(ch04, name)
        if callable(obj) and getattr(obj, "__module__", "") == ch04.__name__ and not name.startswith("_"):
            assert name.startswith("check_"), f"ch04.{name} is public but not a check"


def test_student_copy_fails_every_check_with_its_label(capsys):
    """The chapter's student copy: each exercise's stub reaches its check, which fails saying it is not written."""
    import json
    from collections import deque
    from pathlib import Path

    from kvcourse.instructor import find_exercises, student_copy
    from kvcourse.instructor.notebook import cell_source

    chapter = Path(__file__).resolve().parents[1] / "book" / "04_paged_kv_cache.ipynb"
    student = student_copy(json.loads(chapter.read_text()))
    exercises = find_exercises(student)
    assert len(exercises) >= 4
    for exercise in exercises:
        namespace = {
            "ch04": ch04,
            "deque": deque,
            "BlockManager": BlockManager,
            "make_trace": make_trace,
            "block_size_sweep": block_size_sweep,
        }
        for i in exercise.code_cells:  # the bug hunt's own code cell runs first, then the stub
            exec(cell_source(student["cells"][i]), namespace)  # nothing raises: "Run all" goes on
        said = capsys.readouterr().out
        assert "Not done yet" in said and "Correct" not in said, (exercise.label, said)
        stub = cell_source(student["cells"][exercise.code_cells[-1]])
        assert exercise.label in said or f"= NotImplemented  # {exercise.label}" in stub, (exercise.label, said)
        if exercise.label == "ch04-ex-bughunt":  # issue 47: the stub's docstring must not state the bug or its fix
            assert not any(word in stub for word in ("copy-on-write", "discard", "removes the sequence")), stub


# --- exercise 5: the live share of max-length reservations ----------------------------------------
def right_reservation_live(prompt_lens, output_lens, max_len):
    steps = sum(output_lens)
    held = sum(o * p + o * (o + 1) / 2 for p, o in zip(prompt_lens, output_lens))  # sum of p + k, k = 1 .. o
    return held / steps / max_len


def test_reservation_live_accepts_the_time_weighted_model(capsys):
    assert ch04.check_reservation_live(right_reservation_live)
    assert "Correct" in capsys.readouterr().out


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda p, o, m: _mean([a + (b + 1) / 2 for a, b in zip(p, o)]) / m, "counted once"),
        (lambda p, o, m: sum(b * (a + b) for a, b in zip(p, o)) / sum(o) / m, "final length"),
        (lambda p, o, m: _mean([a + b for a, b in zip(p, o)]) / m, "mean final length"),
        (lambda p, o, m: sum(b * (a + b / 2) for a, b in zip(p, o)) / sum(o) / m, "Half a token"),
        (lambda p, o, m: sum(b * (b + 1) / 2 for b in o) / sum(o) / m, "prompt is held"),
        (
            lambda p, o, m: (
                sum((a + b) * (a + (b + 1) / 2) for a, b in zip(p, o)) / sum(a + b for a, b in zip(p, o)) / m
            ),
            "not prompt_len \\+ output_len",
        ),
        (lambda p, o, m: 0.5, "Weight each request by output_len"),
    ],
)
def test_reservation_live_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_reservation_live(wrong)


def test_reservation_live_refuses_the_package_model():
    from kvcourse.fragmentation import reservation_live_fraction

    with pytest.raises(ExerciseError, match="reservation_live_fraction"):
        ch04.check_reservation_live(lambda p, o, m: reservation_live_fraction(p, o, m))
