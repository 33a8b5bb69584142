"""Chapter 6's phase exercises: right answers pass on the step harness, each typical mistake gets its hint."""

from __future__ import annotations

import random

import pytest

from kvcourse.exercises import ExerciseError, ch06, ch06_phases
from kvcourse.exercises._core import case_rng


def ceil(a, b):
    return -(-a // b)


# ---- answers written here, apart from the module's references --------------------------------------
def running(rs, budget, free, bs, *, cap=True, order=1, victim=-1, frees=True, partial=True, one=False):
    """Phase 1 as a learner would write it; the keywords make the typical mistakes."""
    rs = rs[::order]
    alive = [s["seq_id"] for s in rs]
    scheduled, preempted = [], []
    for s in rs:
        if budget <= 0:
            break
        if s["seq_id"] not in alive:
            continue
        left = s["num_tokens"] - s["num_computed_tokens"]
        n = 1 if one else min(left, budget) if cap else left
        need = ceil(s["num_computed_tokens"] + n, bs) - s["num_blocks"] if partial else ceil(n, bs)
        while need > free:
            rest = alive[alive.index(s["seq_id"]) :]
            v = rest[victim]
            alive.remove(v)
            preempted.append(v)
            free += next(x["num_blocks"] for x in rs if x["seq_id"] == v) if frees else 0
            if v == s["seq_id"]:
                break
        if s["seq_id"] in alive:
            free -= need
            budget -= n
            scheduled.append((s["seq_id"], n))
    return scheduled, preempted


def waiting(ws, budget, free, bs, seats, *, skip=False, cap=True, whole=False, per_prompt=False, seat=True, keep=0):
    """Admission as a learner would write it; the keywords make the typical mistakes."""
    out = []
    for w in ws:
        if budget <= 0 or (seat and seats == 0):
            break
        if whole and w["num_tokens"] > budget:
            break
        n = min(w["num_tokens"], budget) if cap else w["num_tokens"]
        need = ceil(w["num_tokens"] if per_prompt else n, bs)
        if need > free - keep:
            if skip:
                continue
            break
        out.append((w["seq_id"], n))
        budget, free, seats = budget - n, free - need, seats - 1
    return out


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_right_answers_pass(seed):
    assert ch06.check_schedule_running(running, seed=seed)
    assert ch06.check_schedule_waiting(waiting, seed=seed)


def test_the_chapters_first_example_by_hand():
    """Prompts of 3, 20 and 6 tokens, a budget of 16, blocks of 4: the chapter's text walks these steps."""
    log = ch06_phases._log(((3, 20, 6), 4, 32, 4, 16, 8))
    assert log[0][:3] == ([(0, 0, 3), (1, 0, 13)], [0, 1], [])  # 3 + a chunk of 13 = the budget
    assert log[0][3] == 32 - 1 - 4  # 3 tokens take 1 block, 13 take 4
    assert log[1][:3] == ([(0, 3, 1), (1, 13, 7), (2, 0, 6)], [2], [])  # a decode, the rest of the prompt, then 6


def test_the_hidden_traces_chunk_and_preempt():
    """Without chunks and preemptions in the traces, the mistakes about them could not be seen."""
    for check, traces in (
        ("check_schedule_running", ch06_phases._running_traces),
        ("check_schedule_waiting", ch06_phases._waiting_traces),
    ):
        logs = [ch06_phases._log(t) for t in traces(case_rng(check, 0))]
        steps = [step for log in logs for step in log]
        assert any(step[2] for step in steps)  # somebody is preempted
        assert any(
            n < total
            for log, t in zip(logs, traces(case_rng(check, 0)))
            for step in log
            for i, c, n in step[0]
            if c == 0 and (total := t[0][i]) > n
        )  # a first chunk


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda *a: running(*a, cap=False), "A chunk past the budget"),
        (lambda *a: running(*a, order=-1), "Oldest first"),
        (lambda *a: running(*a, one=True), "Not every running sequence is decoding"),
        (lambda *a: running(*a, victim=0), "The victim is the newest"),
        (lambda *a: running(*a, frees=False), "gives its blocks back"),
        (lambda *a: running(*a, partial=False), "partly empty"),
        (lambda rs, b, f, bs: (running(rs, b, f, bs)[0], []), "preempted .* must name|no room|Walk the running"),
        (lambda rs, b, f, bs: [(s["seq_id"], 1) for s in rs], "tuple \\(scheduled, preempted\\)"),
        (lambda rs, b, f, bs: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_running_mistakes_get_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch06.check_schedule_running(wrong)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda *a: waiting(*a, skip=True), "admitted before an older one"),
        (lambda *a: waiting(*a, cap=False), "A chunk past the budget"),
        (lambda *a: waiting(*a, whole=True), "Chunked prefill"),
        (lambda *a: waiting(*a, per_prompt=True), "blocks for its own tokens only"),
        (lambda *a: waiting(*a, seat=False), "Seats"),
        (
            lambda *a: waiting(*a, keep=1),
            "No watermark here: the check runs the scheduler with watermark=0",
        ),  # issue 47
        (
            lambda ws, b, f, bs, s: [(w["seq_id"], min(w["num_tokens"], b)) for w in ws[:1]],
            "no room|Walk the queue|admitted with 0 tokens",
        ),
        (lambda ws, b, f, bs, s: [w["seq_id"] for w in ws], "pairs"),
    ],
)
def test_waiting_mistakes_get_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch06.check_schedule_waiting(wrong)


def test_a_phase_that_schedules_nothing_is_stopped_not_looped():
    with pytest.raises(ExerciseError, match="runs nothing"):
        ch06.check_schedule_waiting(lambda *a: [])


def test_handing_in_the_scheduler_is_refused():
    from kvcourse.serving import Scheduler

    def schedule_waiting(ws, budget, free, bs, seats):
        return Scheduler._schedule_waiting(ws, budget)  # whatever it would do with it

    with pytest.raises(ExerciseError, match="Scheduler"):
        ch06.check_schedule_waiting(schedule_waiting)


def test_an_unwritten_phase_is_reported_not_raised(capsys):
    def schedule_running(running, budget, free_blocks, block_size):
        raise NotImplementedError("ch06-ex-running: write your answer here")

    assert not ch06.check_schedule_running(schedule_running)
    assert "not written yet" in capsys.readouterr().out


def test_the_checks_leave_the_learners_inputs_alone():
    """Each call gets fresh copies: a phase that sorts or pops its list cannot change the next step's view."""
    seen = []

    def popping(rs, budget, free, bs):
        seen.append(len(rs))
        answer = running(rs, budget, free, bs)
        rs.clear()
        return answer

    assert ch06.check_schedule_running(popping)
    assert max(seen) > 1
    random.Random(0)  # the checks seed their own cases: no global state is read
