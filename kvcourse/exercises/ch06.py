"""Checks for chapter 6, *Serving a crowd*: the learner writes three pieces of the scheduler.

1. :func:`check_admit` -- admission under a token budget, with chunked prefill and free blocks.
2. :func:`check_victims` -- which running requests to preempt when the pool runs out.
3. :func:`check_chunk_size` -- the largest prefill chunk that keeps decodes under a TPOT target.

Each check runs the learner's function on hidden cases seeded from the check's ``seed`` argument
and compares it with the package: admission with :class:`kvcourse.serving.Scheduler` itself, the
victims and the chunk size with private references that ``tests/test_exercises_ch06.py`` tests
against the scheduler. Wrong answers are compared with the typical mistakes
(:class:`~kvcourse.exercises._core.Diagnosis`) to say which one they look like.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..paged import BlockManager
from ..sequence import SamplingParams, Sequence
from ..serving.scheduler import Scheduler
from ._core import (
    call_learner,
    case_rng,
    CheckResult,
    describe,
    Diagnosis,
    ExerciseError,
    passed,
    refuse_references,
    wrap_checks,
)

__all__ = ["check_admit", "check_chunk_size", "check_victims"]


def _same(a, b) -> bool:
    return a == b


# --- Exercise 1: admission under a budget --------------------------------------------------------
def _admit(prompt_lens: list[int], token_budget: int, free_blocks: int, block_size: int) -> list[int]:
    """The tokens each waiting request (first come, first served) gets this step, as the scheduler
    decides it for an idle engine with ``free_blocks`` free blocks and no watermark."""
    bm = BlockManager(free_blocks + 1, block_size)
    bm.allocate("someone else", block_size)  # one block in use: a pool with exactly free_blocks free
    sched = Scheduler(bm, max_num_batched_tokens=token_budget, watermark=0)
    for i, n in enumerate(prompt_lens):
        sched.waiting.append(Sequence(i, [1] * n, SamplingParams()))  # queued as add() would, unchecked
    return [s.num_new_tokens for s in sched.schedule().scheduled]


def _admit_wrong(prompt_lens, budget, free, block_size, *, chunked=True, overtake=False, round_down=False,
                 slots=False) -> list[int]:
    """What a typical wrong admission returns."""
    out, left, room = [], budget, free * block_size if slots else free
    for n in prompt_lens:
        if left == 0:
            break
        take = min(n, left) if chunked else n
        need = take if slots else take // block_size if round_down else -(-take // block_size)
        if take > left or need > room:
            if overtake:
                continue
            break
        room -= need
        left -= take
        out.append(take)
    return out


_ADMIT_MISTAKES = [
    ("First come, first served: when the request at the head does not fit, admission stops; later, smaller requests "
     "must not overtake it.", lambda *case: _admit_wrong(*case, overtake=True)),
    # Asking blocks for the whole prompt instead of the chunk fails exactly where skipping the chunk does.
    ("With chunked prefill a prompt longer than the budget left is admitted with a chunk of min(its tokens, budget "
     "left), and the chunk needs blocks for its own tokens only: the rest of the prompt gets blocks when its later "
     "chunks run.", lambda *case: _admit_wrong(*case, chunked=False)),
    ("Blocks are whole: a chunk of t tokens needs ceil(t / block_size) of them.",
     lambda *case: _admit_wrong(*case, round_down=True)),
    ("Count blocks, not token slots: requests never share a block, so each chunk takes ceil(t / block_size) whole "
     "blocks, its last one partly empty.", lambda *case: _admit_wrong(*case, slots=True)),
]


def _admit_cases(rng) -> list[tuple[list[int], int, int, int]]:
    cases = [
        ([30, 10], 32, 100, 16),  # the second gets a chunk
        ([10, 200, 5], 64, 100, 16),  # the long one takes the rest of the budget; 5 waits
        ([40, 5], 64, 2, 16),  # blocks stop the 40; the 5 must not overtake
        ([17], 64, 1, 16),  # 17 tokens need 2 blocks
        ([10, 10, 10], 64, 2, 16),  # 30 tokens fit 32 slots, but not 2 blocks
        ([10, 10, 10, 10], 64, 2, 16),
        ([20], 64, 1, 16),  # 20 tokens are 2 blocks, not 1
    ]
    for _ in range(30):
        cases.append(([rng.randint(1, 300) for _ in range(rng.randint(1, 6))], rng.choice([16, 64, 256, 512]),
                      rng.randint(0, 40), rng.choice([1, 4, 16])))  # fmt: skip
    return cases


def check_admit(admit: Callable[[list[int], int, int, int], list[int]], seed: int = 0) -> CheckResult:
    """``admit(prompt_lens, token_budget, free_blocks, block_size)`` -> tokens per admitted request, in order."""
    refuse_references(admit, {"Scheduler": Scheduler}, "walk the queue yourself.")
    diagnosis = Diagnosis(_ADMIT_MISTAKES, same=_same, default=(
        "Walk the queue in order: each request gets min(its tokens, budget left) if its blocks are free; stop at the "
        "first that does not fit."))  # fmt: skip
    for case in _admit_cases(case_rng("check_admit", seed)):
        label = f"admit{case}"
        got = call_learner("admit", admit, list(case[0]), *case[1:])
        if not isinstance(got, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
            raise ExerciseError(f"{label} should return a list of ints (tokens per admitted request), got "
                                f"{describe(got)}", case=label)  # fmt: skip
        want = _admit(*case)
        if got != want:
            diagnosis.record(label, case, got, want)
    diagnosis.raise_if_wrong()
    return passed("admission takes requests in order, each min(tokens, budget left), while blocks last.")


# --- Exercise 2: choosing victims ----------------------------------------------------------------
def _victims(running: list[tuple[str, int, int]], free_blocks: int) -> list[str]:
    """Running requests ``(name, blocks_held, new_blocks_needed)``, oldest first, each take their new blocks in
    turn; while the pool is short, the newest running request is preempted and its blocks freed; a request that is
    itself the newest preempts itself. The names preempted, in order."""
    running, free, out = list(running), free_blocks, []
    i = 0
    while i < len(running):
        name, _, need = running[i]
        while need > free:
            victim, held, _ = running.pop()
            free += held
            out.append(victim)
            if victim == name:
                return out
        free -= need
        i += 1
    return out


def _victims_oldest(running, free) -> list[str]:
    """Preempts the oldest request instead of the newest."""
    running, out = list(running), []
    i = 0
    while i < len(running):
        name, _, need = running[i]
        while need > free and running:
            victim, held, _ = running.pop(0)
            free += held
            out.append(victim)
            if victim == name:
                break
        if name in out:
            continue  # the list shifted: running[i] is the next request
        free -= need
        i += 1
    return out


def _victims_self(running, free) -> list[str]:
    """A request short of blocks gives up its own."""
    out = []
    for name, held, need in running:
        if need > free:
            out.append(name)
            free += held
        else:
            free -= need
    return out


_VICTIM_MISTAKES = [
    ("Preempt the newest running request (the last admitted): it has done the least work, and the oldest requests "
     "then always finish.", _victims_oldest),
    ("A request that needs a block does not give up its own first: it takes the blocks of the newest request; only "
     "when it is itself the newest does it preempt itself.", _victims_self),
]


def _victim_cases(rng) -> list[tuple[list[tuple[str, int, int]], int]]:
    cases = [
        ([("a", 3, 1), ("b", 2, 1)], 1),  # a takes the last block; b is the newest and preempts itself
        ([("a", 3, 1), ("b", 2, 0), ("c", 1, 1)], 0),  # a preempts c; b needs nothing
        ([("a", 2, 1), ("b", 4, 0), ("c", 2, 0)], 0),
        ([("a", 1, 1)], 1),  # no preemption
        ([("a", 5, 1), ("b", 1, 1), ("c", 1, 1), ("d", 1, 1)], 0),
    ]
    for _ in range(30):
        k = rng.randint(1, 7)
        cases.append(([(chr(97 + j), rng.randint(1, 6), rng.choice([0, 1, 1, 2])) for j in range(k)],
                      rng.randint(0, 3)))  # fmt: skip
    return cases


def check_victims(preempt: Callable[[list[tuple[str, int, int]], int], list[str]], seed: int = 0) -> CheckResult:
    """``preempt(running, free_blocks)`` -> names of the preempted requests, in the order preempted."""
    diagnosis = Diagnosis(_VICTIM_MISTAKES, same=_same, default=(
        "Serve the oldest first; while it is short of blocks, pop the newest running request and free its blocks; "
        "stop when the one being served is itself popped."))  # fmt: skip
    for running, free in _victim_cases(case_rng("check_victims", seed)):
        label = f"preempt({running}, {free})"
        got = call_learner("preempt", preempt, list(running), free)
        if not isinstance(got, list):
            raise ExerciseError(f"{label} should return a list of names, got {describe(got)}", case=label)
        want = _victims(running, free)
        if got != want:
            diagnosis.record(label, (running, free), got, want)
    diagnosis.raise_if_wrong()
    return passed("the oldest requests keep running; the newest give their blocks back, one at a time.")


# --- Exercise 3: a chunk size --------------------------------------------------------------------
def _chunk_size(fixed_ms: float, per_token_ms: float, num_decodes: int, tpot_ms: float) -> int:
    """The largest prefill chunk such that a step of ``num_decodes`` decode tokens plus the chunk takes at most
    ``tpot_ms``, when a step of ``t`` tokens takes ``fixed_ms + per_token_ms * t``; 0 if the decodes alone miss."""
    return max(0, math.floor((tpot_ms - fixed_ms) / per_token_ms) - num_decodes)


_CHUNK_MISTAKES = [
    ("When the decodes alone miss the target, no chunk fits: return 0, not a negative number.",
     lambda f, p, d, t: math.floor((t - f) / p) - d),
    ("The running requests' decode tokens share the step with the chunk: subtract them.",
     lambda f, p, d, t: max(0, math.floor((t - f) / p))),
    ("Round down: one token more and the step misses the target.",
     lambda f, p, d, t: max(0, math.ceil((t - f) / p) - d)),
    ("The fixed cost is paid once per step, not per token: fixed_ms + per_token_ms * tokens.",
     lambda f, p, d, t: max(0, math.floor(t / (f + p)) - d)),
]


def _chunk_cases(rng) -> list[tuple[float, float, int, float]]:
    cases = [(40.0, 0.25, 8, 100.0), (40.0, 0.25, 8, 60.5), (40.0, 0.5, 100, 60.0), (10.0, 0.1, 0, 20.05)]
    while len(cases) < 30:
        case = (round(rng.uniform(5, 80), 2), round(rng.uniform(0.05, 2), 3), rng.randint(0, 64),
                round(rng.uniform(20, 400), 1))  # fmt: skip
        exact = (case[3] - case[0]) / case[1]
        if abs(exact - round(exact)) > 1e-6:  # clear of float ties at the boundary, whatever way it is computed
            cases.append(case)
    return cases


def check_chunk_size(chunk_size: Callable[[float, float, int, float], int], seed: int = 0) -> CheckResult:
    """``chunk_size(fixed_ms, per_token_ms, num_decodes, tpot_ms)`` -> the largest chunk (tokens, >= 0)."""
    diagnosis = Diagnosis(_CHUNK_MISTAKES, same=_same, default=(
        "Solve fixed_ms + per_token_ms * (num_decodes + chunk) <= tpot_ms for the largest whole chunk."))
    for case in _chunk_cases(case_rng("check_chunk_size", seed)):
        label = f"chunk_size{case}"
        got = call_learner("chunk_size", chunk_size, *case)
        if isinstance(got, bool) or not isinstance(got, int):
            raise ExerciseError(f"{label} should return an int number of tokens, got {describe(got)}", case=label)
        want = _chunk_size(*case)
        if got != want:
            diagnosis.record(label, case, got, want)
    diagnosis.raise_if_wrong()
    return passed(f"with 40 ms per step plus 0.25 ms per token and 8 decodes, a 100 ms target leaves room for a "
                  f"chunk of {_chunk_size(40.0, 0.25, 8, 100.0)} tokens.")  # fmt: skip


wrap_checks(globals())  # an unwritten answer is reported ("Not done yet"), not raised: see _core.reports_unfinished
