"""Chapter 6's checks: the references agree with the scheduler, right answers pass, typical mistakes get their hint."""

from __future__ import annotations

import math
import random

import pytest

from kvcourse.exercises import ExerciseError, ch06
from kvcourse.paged import BlockManager
from kvcourse.sequence import SamplingParams, Sequence, SequenceStatus
from kvcourse.serving import Scheduler


# ---- the references -----------------------------------------------------------------------------
def test_admit_reference_by_hand():
    assert ch06._admit([30, 10], 32, 100, 16) == [30, 2]
    assert ch06._admit([10, 200, 5], 64, 100, 16) == [10, 54]
    assert ch06._admit([40, 5], 64, 2, 16) == []  # 40 tokens need 3 blocks; 5 may not overtake
    assert ch06._admit([17], 64, 1, 16) == []
    assert ch06._admit([17], 64, 2, 16) == [17]


def test_victims_reference_equals_the_scheduler():
    """Random pools: the reference's victims are exactly those Scheduler.schedule() preempts."""
    rng = random.Random(1)
    for _ in range(200):
        bs, free = 4, rng.randint(0, 3)
        running = [(f"r{j}", rng.randint(1, 5), rng.choice([0, 1])) for j in range(rng.randint(1, 6))]
        bm = BlockManager(sum(h for _, h, _ in running) + free, bs)
        sched = Scheduler(bm, watermark=0)
        for name, held, need in running:
            # a decoding sequence whose next token needs a new block (need 1: its blocks are full) or not
            computed = held * bs - (0 if need else 1)
            seq = Sequence(name, [1] * computed, SamplingParams(max_new_tokens=100))
            seq.append_token(1)
            seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
            bm.allocate(name, computed)
            sched.running.append(seq)
        out = sched.schedule()
        assert [s.seq_id for s in out.preempted] == ch06._victims(running, free), (running, free)


def test_chunk_size_reference():
    assert ch06._chunk_size(40.0, 0.25, 8, 100.0) == 232  # (100 - 40) / 0.25 = 240 tokens, 8 are decodes
    assert ch06._chunk_size(40.0, 0.5, 100, 60.0) == 0  # the decodes alone take 90 ms
    for args in ch06._chunk_cases(random.Random(3)):
        c = ch06._chunk_size(*args)
        fixed, per, decodes, tpot = args
        if c:
            assert fixed + per * (decodes + c) <= tpot < fixed + per * (decodes + c + 1)


# ---- right answers pass --------------------------------------------------------------------------
def right_admit(prompt_lens, budget, free, bs):
    out = []
    for n in prompt_lens:
        take = min(n, budget)
        need = -(-take // bs)
        if take == 0 or need > free:
            break
        out.append(take)
        budget -= take
        free -= need
    return out


def right_preempt(running, free):
    running, out = list(running), []
    i = 0
    while i < len(running):
        name, _, need = running[i]
        while need > free and name not in out:
            victim = running.pop()
            free += victim[1]
            out.append(victim[0])
        if name in out:
            break
        free -= need
        i += 1
    return out


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_right_answers_pass(seed):
    assert ch06.check_admit(right_admit, seed=seed)
    assert ch06.check_victims(right_preempt, seed=seed)
    assert ch06.check_chunk_size(lambda f, p, d, t: max(0, math.floor((t - f) / p) - d), seed=seed)


def test_handing_in_the_scheduler_is_refused():
    def admit(prompt_lens, budget, free, bs):
        from kvcourse.serving import Scheduler  # noqa: F401
        return Scheduler  # whatever it does with it

    with pytest.raises(ExerciseError, match="Scheduler"):
        ch06.check_admit(admit)


# ---- wrong answers get their hint ----------------------------------------------------------------
def overtaking_admit(prompt_lens, budget, free, bs):
    out = []
    for n in prompt_lens:
        take = min(n, budget)
        need = -(-take // bs)
        if take == 0 or need > free:
            continue
        out.append(take)
        budget -= take
        free -= need
    return out


def round_down_admit(prompt_lens, budget, free, bs):
    out = []
    for n in prompt_lens:
        take = min(n, budget)
        need = take // bs
        if take == 0 or need > free:
            break
        out.append(take)
        budget -= take
        free -= need
    return out


def no_chunk_admit(prompt_lens, budget, free, bs):
    out = []
    for n in prompt_lens:
        need = -(-n // bs)
        if n > budget or need > free:
            break
        out.append(n)
        budget -= n
        free -= need
    return out


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (overtaking_admit, "must not overtake"),
        (no_chunk_admit, "chunk of"),
        (lambda p, b, f, bs: right_admit(p, b, f * bs, 1), "Count blocks, not token slots"),
        (round_down_admit, "Blocks are whole"),
        (lambda p, b, f, bs: [min(p[0], b)], "Walk the queue"),
        (lambda p, b, f, bs: "30", "list of ints"),
        (lambda p, b, f, bs: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_admit_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch06.check_admit(wrong)


def whole_prompt_blocks(prompt_lens, budget, free, bs):
    out = []
    for n in prompt_lens:
        take = min(n, budget)
        need = -(-n // bs)  # blocks for the whole prompt, not the chunk
        if take == 0 or need > free:
            break
        out.append(take)
        budget -= take
        free -= need
    return out


def test_admit_hint_for_blocks_of_the_whole_prompt():
    with pytest.raises(ExerciseError, match="needs blocks for its own tokens only"):
        ch06.check_admit(whole_prompt_blocks)


def oldest_victim(running, free):
    running, out = list(running), []
    i = 0
    while i < len(running):
        name, _, need = running[i]
        while need > free and running:
            victim = running.pop(0)
            free += victim[1]
            out.append(victim[0])
            if victim[0] == name:
                break
        if name in out:
            continue
        free -= need
        i += 1
    return out


def self_victim(running, free):
    out = []
    for name, held, need in running:
        if need > free:
            out.append(name)
            free += held
        else:
            free -= need
    return out


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (oldest_victim, "newest running request"),
        (self_victim, "does not give up its own first"),
        (lambda r, f: [], "Serve the oldest first"),
        (lambda r, f: "a", "list of names"),
    ],
)
def test_victims_reject_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch06.check_victims(wrong)


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
