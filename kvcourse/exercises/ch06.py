"""Checks for chapter 6, *Serving a crowd*: the learner writes three pieces of the scheduler.

1. :func:`check_admit` -- admission under a token budget, with chunked prefill and free blocks.
2. :func:`check_victims` -- which running requests to preempt when the pool runs out.
3. :func:`check_chunk_size` -- the largest prefill chunk that keeps decodes under a TPOT target.

Each check runs the learner's function on hidden seeded cases and compares it with the package:
:func:`admit` asks :class:`kvcourse.serving.Scheduler` itself, :func:`victims` and
:func:`chunk_size` are tested against it in ``tests/test_exercises_ch06.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from ..paged import BlockManager
from ..sequence import SamplingParams, Sequence
from ..serving.scheduler import Scheduler
from ._core import ExerciseError, call_learner, expect_equal, passed

__all__ = ["admit", "check_admit", "check_chunk_size", "check_victims", "chunk_size", "victims"]


# ---- 1. admission under a budget ----------------------------------------------------------------
def admit(prompt_lens: list[int], token_budget: int, free_blocks: int, block_size: int) -> list[int]:
    """Reference: the tokens each waiting request (first come, first served) gets this step, as the
    scheduler decides it for an idle engine with ``free_blocks`` free blocks and no watermark."""
    bm = BlockManager(free_blocks + 1, block_size)
    bm.allocate("someone else", block_size)  # one block in use: a pool with exactly free_blocks free
    sched = Scheduler(bm, max_num_batched_tokens=token_budget, watermark=0)
    for i, n in enumerate(prompt_lens):
        sched.waiting.append(Sequence(i, [1] * n, SamplingParams()))  # queued as add() would, unchecked
    return [s.num_new_tokens for s in sched.schedule().scheduled]


def _admit_variants(prompt_lens, budget, free, bs) -> dict[str, list[int]]:
    """Typical wrong answers, to say which mistake was made."""
    def run(chunked=True, overtake=False, whole_blocks=False, round_down=False, slots=False):
        out, left, blocks = [], budget, free * bs if slots else free
        for n in prompt_lens:
            if left == 0:
                break
            take = min(n, left) if chunked else n
            if take > left:
                if overtake:
                    continue
                break
            need_tokens = n if whole_blocks else take
            need = need_tokens if slots else need_tokens // bs if round_down else -(-need_tokens // bs)
            if need > blocks:
                if overtake:
                    continue
                break
            blocks -= need
            left -= take
            out.append(take)
        return out

    return {
        "overtake": run(overtake=True),
        "no_chunks": run(chunked=False),
        "whole_blocks": run(whole_blocks=True),
        "round_down": run(round_down=True),
        "slots": run(slots=True),
    }


_ADMIT_HINTS = {
    "overtake": "First come, first served: when the request at the head does not fit, admission stops; "
                "later, smaller requests must not overtake it.",
    "no_chunks": "With chunked prefill, a prompt longer than the budget left is admitted with a chunk of "
                 "min(its tokens, budget left), not skipped.",
    "whole_blocks": "A chunk needs blocks for its own tokens only; the rest of its prompt gets blocks when "
                    "its later chunks run.",
    "round_down": "Blocks are whole: a chunk of t tokens needs ceil(t / block_size) of them.",
    "slots": "Count blocks, not token slots: requests never share a block, so each chunk takes "
             "ceil(t / block_size) whole blocks, its last one partly empty.",
}


def _admit_cases() -> list[tuple[list[int], int, int, int]]:
    cases = [
        ([30, 10], 32, 100, 16),  # chunk of the second
        ([100], 32, 100, 16),  # one chunk
        ([10, 200, 5], 64, 100, 16),  # the long one takes the rest of the budget; 5 waits
        ([40, 5], 64, 2, 16),  # blocks stop the 40; the 5 must not overtake
        ([17], 64, 1, 16),  # 17 tokens need 2 blocks
        ([8, 8, 8], 16, 10, 4),
        ([10, 10, 10], 64, 2, 16),  # 30 tokens fit 32 slots, but not 2 blocks
    ]
    rng = random.Random(606)
    for _ in range(40):
        bs = rng.choice([1, 4, 16])
        cases.append(([rng.randint(1, 300) for _ in range(rng.randint(1, 6))], rng.choice([16, 64, 256, 512]),
                      rng.randint(0, 40), bs))  # fmt: skip
    return cases


def _mistake(got_all: list, variants_all: list[dict], hints: dict[str, str]) -> str:
    """The hint of the typical mistake that gives exactly the learner's answers on every case."""
    for name, hint in hints.items():
        if all(v[name] == g for v, g in zip(variants_all, got_all)):
            return hint
    return ""


def check_admit(fn: Callable[[list[int], int, int, int], list[int]]) -> bool:
    """``fn(prompt_lens, token_budget, free_blocks, block_size)`` -> tokens per admitted request."""
    cases = _admit_cases()
    got_all = []
    for prompt_lens, budget, free, bs in cases:
        args = (list(prompt_lens), budget, free, bs)
        got = call_learner("admit", fn, *args)
        if not isinstance(got, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
            raise ExerciseError(f"admit{args} should return a list of ints (tokens per admitted request), got {got!r}")
        got_all.append(got)
    for (prompt_lens, budget, free, bs), got in zip(cases, got_all):
        want = admit(prompt_lens, budget, free, bs)
        if got == want:
            continue
        hint = _mistake(got_all, [_admit_variants(*c) for c in cases], _ADMIT_HINTS)
        if not hint and sum(got) > budget:
            hint = f"The step's tokens must not exceed token_budget={budget}."
        expect_equal(f"admit{(prompt_lens, budget, free, bs)}", got, want, hint=hint or "Walk the queue in order: "
                     "each request gets min(its tokens, budget left), if its blocks are free; stop at the first "
                     "that does not fit.")  # fmt: skip
    return passed("admission takes requests in order, each min(tokens, budget left), while blocks last.")


# ---- 2. choosing victims ------------------------------------------------------------------------
def victims(running: list[tuple[str, int, int]], free_blocks: int) -> list[str]:
    """Reference: running requests ``(name, blocks_held, new_blocks_needed)``, oldest first. Each in
    turn takes its new blocks; while the pool is short, the newest running request is preempted and
    its blocks freed; a request that is itself the newest preempts itself. The names preempted, in order."""
    running, free, out = list(running), free_blocks, []
    i = 0
    while i < len(running):
        name, _, need = running[i]
        while need > free:
            victim, held, _ = running.pop()
            free += held
            out.append(victim)
            if victim == name:
                break
        else:
            free -= need
            i += 1
            continue
        break
    return out


def _victim_variants(running, free) -> dict[str, list[str]]:
    def oldest_first():
        rs, f, out = list(running), free, []
        i = 0
        while i < len(rs):
            name, _, need = rs[i]
            while need > f and rs:
                v = rs.pop(0)
                f += v[1]
                out.append(v[0])
                if v[0] == name:
                    break
            if name in out:
                continue
            f -= need
            i += 1
        return out

    def self_first():
        rs, f, out = list(running), free, []
        for name, held, need in rs:
            if need > f:
                out.append(name)
                f += held
            else:
                f -= need
        return out

    return {"oldest": oldest_first(), "self": self_first()}


_VICTIM_HINTS = {
    "oldest": "Preempt the newest running request (the last admitted): it has done the least work and "
              "the oldest ones finish soonest.",
    "self": "A request that needs a block does not give up its own first: it takes the blocks of the newest "
            "request; only when it is itself the newest does it preempt itself.",
}


def _victim_cases() -> list[tuple[list[tuple[str, int, int]], int]]:
    cases = [
        ([("a", 3, 1), ("b", 2, 1)], 1),  # b gets nothing: a takes the last block, b preempts itself
        ([("a", 3, 1), ("b", 2, 0), ("c", 1, 1)], 0),  # a preempts c, takes one of c's... c had 1
        ([("a", 2, 1), ("b", 4, 0), ("c", 2, 0)], 0),
        ([("a", 1, 1)], 1),  # no preemption
        ([("a", 5, 1), ("b", 1, 1), ("c", 1, 1), ("d", 1, 1)], 0),
    ]
    rng = random.Random(607)
    for _ in range(40):
        k = rng.randint(1, 7)
        cases.append(([(chr(97 + j), rng.randint(1, 6), rng.choice([0, 1, 1, 2])) for j in range(k)], rng.randint(0, 3)))
    return cases


def check_victims(fn: Callable[[list[tuple[str, int, int]], int], list[str]]) -> bool:
    """``fn(running, free_blocks)`` -> names of the preempted requests, in the order preempted."""
    cases = _victim_cases()
    got_all = []
    for running, free in cases:
        got = call_learner("preempt", fn, [tuple(r) for r in running], free)
        if not isinstance(got, list):
            raise ExerciseError(f"preempt{(running, free)} should return a list of names, got {got!r}")
        got_all.append(got)
    for (running, free), got in zip(cases, got_all):
        want = victims(running, free)
        if got == want:
            continue
        hint = _mistake(got_all, [_victim_variants(*c) for c in cases], _VICTIM_HINTS)
        if not hint and set(got) == set(want):
            hint = "The right requests, in the wrong order: the newest goes first."
        if not hint and len(got) > len(want):
            hint = "Preempt only while the request being served is short of blocks, one victim at a time."
        expect_equal(f"preempt{(running, free)}", got, want, hint=hint or "Serve the oldest first; while it is "
                     "short of blocks, pop the newest running request and free its blocks.")  # fmt: skip
    return passed("the oldest requests keep running; the newest give their blocks back, one at a time.")


# ---- 3. a chunk size ----------------------------------------------------------------------------
def chunk_size(fixed_ms: float, per_token_ms: float, num_decodes: int, tpot_ms: float) -> int:
    """Reference: the largest prefill chunk (tokens) such that a step of ``num_decodes`` decode tokens
    plus the chunk takes at most ``tpot_ms``, when a step of ``t`` tokens takes
    ``fixed_ms + per_token_ms * t``; 0 if the decodes alone already miss the target."""
    return max(0, math.floor((tpot_ms - fixed_ms) / per_token_ms) - num_decodes)


def _chunk_cases() -> list[tuple[float, float, int, float]]:
    cases = [(40.0, 0.25, 8, 100.0), (40.0, 0.25, 8, 60.5), (40.0, 0.5, 100, 60.0), (10.0, 0.1, 0, 20.05)]
    rng = random.Random(608)
    while len(cases) < 30:
        case = (round(rng.uniform(5, 80), 2), round(rng.uniform(0.05, 2), 3), rng.randint(0, 64),
                round(rng.uniform(20, 400), 1))  # fmt: skip
        exact = (case[3] - case[0]) / case[1]
        if abs(exact - round(exact)) > 1e-6:  # keep clear of float ties at the boundary
            cases.append(case)
    return cases


def check_chunk_size(fn: Callable[[float, float, int, float], int]) -> bool:
    """``fn(fixed_ms, per_token_ms, num_decodes, tpot_ms)`` -> the largest chunk (tokens, >= 0)."""
    for args in _chunk_cases():
        got = call_learner("chunk_size", fn, *args)
        if isinstance(got, bool) or not isinstance(got, int):
            raise ExerciseError(f"chunk_size{args} should return an int number of tokens, got {got!r}")
        want = chunk_size(*args)
        fixed, per, decodes, tpot = args
        tokens = (tpot - fixed) / per
        if got < 0:
            hint = "When the decodes alone miss the target, no chunk fits: return 0."
        elif got == math.floor(tokens) and want != got:
            hint = "The running requests' decode tokens share the step with the chunk: subtract them."
        elif got == math.ceil(tokens) - decodes and want != got:
            hint = "Round down: one token more and the step misses the target."
        else:
            hint = "Solve fixed_ms + per_token_ms * (num_decodes + chunk) <= tpot_ms for the largest whole chunk."
        expect_equal(f"chunk_size{args}", got, want, hint=hint)
    return passed(f"with 40 ms per step plus 0.25 ms per token and 8 decodes, a 100 ms target leaves "
                  f"room for a chunk of {chunk_size(40.0, 0.25, 8, 100.0)} tokens.")
