"""Checks for chapter 6, *Serving a crowd*: the learner writes four pieces of the scheduler.

1. :func:`check_schedule_running` -- phase 1 of a step: the running sequences' tokens and slots, preempting the
   newest while the pool is short (in :mod:`.ch06_phases`).
2. :func:`check_schedule_waiting` -- phase 2: admission under the token budget, with chunks (in :mod:`.ch06_phases`).
3. :func:`check_victims` -- the preemption policy, plugged into :class:`~kvcourse.serving.Engine`: which
   running request gives way when the pool runs out.
4. :func:`check_chunk_size` -- the largest prefill chunk that keeps decodes under a TPOT target.
5. :func:`check_predicted_ttft` -- predict first: a long prompt's steps and time to first token beside decoding
   requests, from the scheduler's rules and the step-cost model, checked against the Scheduler itself.

Each check runs the learner's function on hidden cases seeded from the check's ``seed`` argument
and compares it with the package: the two phases step by step against :class:`kvcourse.serving.Scheduler`
itself; the victim policy in the scheduler on workloads without a model, then in the engine on the real model
(outputs equal to solo runs, preemptions equal to vLLM's policy); the chunk size with a private
reference that ``tests/test_exercises_ch06.py`` tests. Wrong answers are compared with the typical mistakes
(:class:`~kvcourse.exercises._core.Diagnosis`) to say which one they look like.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

from ..paged import BlockManager
from ..sequence import SamplingParams, Sequence
from ..serving.scheduler import Scheduler, preempt_newest
from ._core import CheckResult, ExerciseError, an_int, call_learner, check, describe, diagnose, hidden_rng, mistaken
from ._core import passed
from .ch06_phases import check_schedule_running, check_schedule_waiting

__all__ = [
    "check_chunk_size",
    "check_predicted_ttft",
    "check_schedule_running",
    "check_schedule_waiting",
    "check_victims",
]


# --- Exercise 3: the victim policy, in the real engine ----------------------------------------------
# A case is a workload: (prompt_lens, max_new_tokens, num_blocks, block_size, max_num_batched_tokens).
Workload = tuple[tuple[int, ...], int, int, int, int]
_MAX_STEPS = 2000  # the workloads finish in under 100 steps under any sane policy


def _preemptions(case: Workload, policy: Callable | None) -> tuple[list[tuple[int, int]], int]:
    """Drive :class:`~kvcourse.serving.Scheduler` with ``policy`` through ``case`` without a model (the
    decisions do not depend on the tokens: every request makes exactly its ``max_new_tokens``).
    Returns ``([(step, request preempted), ...], tokens recomputed)``."""
    prompt_lens, max_new, num_blocks, block_size, budget = case
    sched = Scheduler(
        BlockManager(num_blocks, block_size), max_num_batched_tokens=budget, watermark=0, preemption_policy=policy
    )
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=())
    for i, n in enumerate(prompt_lens):
        sched.add(Sequence(i, [1] * n, params))
    log, recomputed, step = [], 0, 0
    while sched.has_unfinished():
        if step == _MAX_STEPS:
            raise ExerciseError(
                f"workload {case} did not finish in {_MAX_STEPS} steps: the requests keep preempting each other",
                case=str(case),
            )
        out = sched.schedule()
        log += [(step, seq.seq_id) for seq in out.preempted]
        recomputed += sum(s.num_recomputed_tokens for s in out.scheduled)
        sched.advance_without_model(out)
        step += 1
    return log, recomputed


def _pick_victim(candidates: list[Sequence]) -> Sequence:
    """vLLM's choice: the newest (the package's :func:`~kvcourse.serving.scheduler.preempt_newest`)."""
    return candidates[-1]


def _by(key, largest: bool, last_on_ties: bool) -> Callable:
    """A policy choosing by ``key`` (the first or the last of equal candidates)."""

    def policy(candidates):
        pool = list(reversed(candidates)) if last_on_ties else candidates
        return (max if largest else min)(pool, key=key)

    return policy


def _describe_run(log: list[tuple[int, int]], recomputed: int) -> str:
    return (", ".join(f"step {s}: request {r}" for s, r in log) or "nobody") + f"; {recomputed} tokens recomputed"


def _run(case: Workload, policy: Callable) -> str:
    """What the preemptions of ``case`` under ``policy`` look like in a failure message."""
    return _describe_run(*_preemptions(case, policy))


def _lengths(largest: bool) -> list[Callable]:
    return [_by(lambda s: s.num_tokens, largest, last) for last in (False, True)]


_VICTIM_MISTAKES = [
    (
        "candidates[0] is the request that asks for the block, and the oldest of them: preempting it makes the "
        "oldest request give way to newer ones, and under steady pressure it may never finish (it starves). Keep "
        "the arrival order: the newest running request gives way.",
        lambda case: _run(case, lambda c: c[0]),
    ),
    *[
        (
            "Choosing by length (the longest frees the most blocks at once) lets shorter newcomers preempt a long "
            "request again and again, and it is the costliest to recompute. The rule is about arrival order, not size: "
            "the newest gives way.",
            lambda case, f=f: _run(case, f),
        )
        for f in _lengths(largest=True)
    ],
    *[
        (
            "Choosing the shortest, or the one that has done the least work, is not the rule: the newest request may "
            "well have prefilled a long prompt. Preempting the newest keeps first come, first served: the oldest "
            "request is never preempted while a newer one runs, so nobody starves.",
            lambda case, f=f: _run(case, f),
        )
        for f in [
            *_lengths(largest=False),
            *[_by(lambda s: s.num_computed_tokens, False, last) for last in (False, True)],
        ]
    ],
]


def _victim_cases(rng) -> list[Workload]:
    cases: list[Workload] = [
        ((30, 5, 18, 9), 16, 17, 4, 64),  # three policies, three different victim lists
        ((8, 8, 8), 8, 9, 4, 64),  # equal lengths: only the order tells them apart
        ((40, 4, 4, 4), 12, 16, 4, 32),  # a long prompt first, short ones after it
        ((6, 20, 3, 12, 9), 10, 14, 4, 48),
    ]
    while len(cases) < 12:
        k, bs, max_new = rng.randint(3, 6), rng.choice([2, 4]), rng.randint(4, 16)
        lens = tuple(rng.randint(1, 24) for _ in range(k))
        need = -(-(max(lens) + max_new - 1) // bs)  # the biggest request must fit alone
        case = (lens, max_new, rng.randint(need, need + 4), bs, rng.choice([16, 32, 64]))
        if _preemptions(case, None)[0]:  # pressure: somebody is preempted
            cases.append(case)
    return cases


_FIELDS = ("seq_id", "num_prompt_tokens", "num_tokens", "num_computed_tokens")


def _learner_policy(pick_victim: Callable) -> Callable:
    """The learner's function as the scheduler's preemption policy. It is handed each candidate as a dict of the
    Sequence's counts (plain data: the grader runs it in another process, where a Sequence cannot be lent) and
    returns one of the dicts; a crash, or anything else returned, says where."""

    def policy(candidates: list[Sequence]) -> Sequence:
        views = [{f: getattr(seq, f) for f in _FIELDS} for seq in candidates]
        got = call_learner("pick_victim", pick_victim, [dict(v) for v in views])  # copies: it may pop or sort them
        for seq, view in zip(candidates, views):
            if isinstance(got, dict) and got == view:
                return seq
        raise ExerciseError(
            f"pick_victim({views}) returned {describe(got)}: return one of the candidates (the dict "
            f"itself, not its seq_id or its position)"
        )

    return policy


def _run_trace(case: Workload, pick_victim: Callable) -> tuple[list[tuple[int, int]], int]:
    return _preemptions(case, _learner_policy(pick_victim))


def _engine_case(rng, vocab_size: int) -> tuple[list[list[int]], int, int, int, int]:
    """A few short requests on the real model, in a pool small enough to preempt."""
    while True:
        lens = [rng.randint(4, 20) for _ in range(4)]
        need = -(-(max(lens) + 9) // 4)
        case = (tuple(lens), 10, need + 2, 4, 32)
        if len(_preemptions(case, None)[0]) >= 2:
            prompts = [[rng.randrange(100, vocab_size) for _ in range(n)] for n in lens]
            return prompts, *case[1:]


@check(
    "check_victims",
    takes="pick_victim(candidates)",
    references={"preempt_newest": preempt_newest},
    task="write the choice yourself.",
)
def check_victims(pick_victim: Callable[[list[Sequence]], Sequence], model=None, seed: int = 0) -> CheckResult:
    """``pick_victim(candidates) -> victim``: the scheduler's preemption policy (``Engine(...,
    preemption_policy=...)``). ``candidates``: the running sequences that may give way, oldest first, each as a
    dict of its ``seq_id``, ``num_prompt_tokens``, ``num_tokens`` and ``num_computed_tokens``; ``candidates[0]``
    needs a block and none is free. First on workloads without a model, then in the engine on ``model``
    (SmolLM2, loaded if not given): the outputs must equal each request run alone, and the preemptions the
    expected ones."""
    rng = hidden_rng()
    diagnose(
        pick_victim,
        [(case,) for case in _victim_cases(rng)],
        label=lambda case: (
            f"preemptions in workload (prompt_lens, max_new_tokens, num_blocks, block_size, budget) = {case}"
        ),
        reference=lambda case: _run(case, _pick_victim),
        mistakes=_VICTIM_MISTAKES,
        hint="Under vLLM's policy the newest running request gives way, whatever its size: the last of the candidates.",
        compare=operator.eq,
        call=lambda label, pick_victim, case: _describe_run(*_run_trace(case, pick_victim)),  # inside the Scheduler
    )

    import kvcourse  # the real model, only once the policy is right on the traces
    from ..serving.engine import Engine

    if model is None:
        model, _ = kvcourse.load_pretrained()
    prompts, max_new, num_blocks, block_size, budget = _engine_case(rng, model.config.vocab_size)
    eng = Engine(model, num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget, watermark=0,
                 preemption_policy=_learner_policy(pick_victim))  # fmt: skip
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=max_new, stop_token_ids=()))
    label = f"Engine(model, num_blocks={num_blocks}, block_size={block_size}, preemption_policy=pick_victim)"
    for i, (p, o) in enumerate(zip(prompts, outs)):
        alone = kvcourse.generate(model, p, max_new, eos_token_ids=())
        if o != alone:
            raise ExerciseError(
                f"{label}: request {i}'s output differs from its solo run", case=label, expected=str(alone), got=str(o)
            )
    got = ([(e.step, rid) for e in eng.events for rid, _ in e.preempted], eng.stats["recomputed_tokens"])
    want = _preemptions((tuple(map(len, prompts)), max_new, num_blocks, block_size, budget), _pick_victim)
    if got != want:
        raise ExerciseError(f"{label}: the preemptions differ from vLLM's policy", case=label,
                            expected=_describe_run(*want), got=_describe_run(*got))  # fmt: skip
    return passed(
        f"in the engine on the real model: {len(want[0])} preemptions of the newest request, "
        f"{want[1]} tokens recomputed, every output equal to its solo run."
    )


# --- Exercise 4: a chunk size --------------------------------------------------------------------
def _chunk_size(fixed_ms: float, per_token_ms: float, num_decodes: int, tpot_ms: float) -> int:
    """The largest prefill chunk such that a step of ``num_decodes`` decode tokens plus the chunk takes at most
    ``tpot_ms``, when a step of ``t`` tokens takes ``fixed_ms + per_token_ms * t``; 0 if the decodes alone miss."""
    return max(0, math.floor((tpot_ms - fixed_ms) / per_token_ms) - num_decodes)


_CHUNK_MISTAKES = [
    (
        "When the decodes alone miss the target, no chunk fits: return 0, not a negative number.",
        lambda f, p, d, t: math.floor((t - f) / p) - d,
    ),
    (
        "The running requests' decode tokens share the step with the chunk: subtract them.",
        lambda f, p, d, t: max(0, math.floor((t - f) / p)),
    ),
    (
        "Round down: one token more and the step misses the target.",
        lambda f, p, d, t: max(0, math.ceil((t - f) / p) - d),
    ),
    (
        "The fixed cost is paid once per step, not per token: fixed_ms + per_token_ms * tokens.",
        lambda f, p, d, t: max(0, math.floor(t / (f + p)) - d),
    ),
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


@check("check_chunk_size", takes="chunk_size(fixed_ms, per_token_ms, num_decodes, tpot_ms)")
def check_chunk_size(chunk_size: Callable[[float, float, int, float], int], seed: int = 0) -> CheckResult:
    """``chunk_size(fixed_ms, per_token_ms, num_decodes, tpot_ms)`` -> the largest chunk (tokens, >= 0)."""
    diagnose(
        chunk_size,
        _chunk_cases(hidden_rng()),
        label=lambda *case: f"chunk_size{case}",
        reference=_chunk_size,
        mistakes=_CHUNK_MISTAKES,
        hint="Solve fixed_ms + per_token_ms * (num_decodes + chunk) <= tpot_ms for the largest whole chunk.",
        compare=operator.eq,
        returns=an_int("number of tokens", strict=True),
    )
    return passed(
        f"with 40 ms per step plus 0.25 ms per token and 8 decodes, a 100 ms target leaves room for a "
        f"chunk of {_chunk_size(40.0, 0.25, 8, 100.0)} tokens."
    )


# --- Exercise 5: predict a long prompt's first token ---------------------------------------------
# A case: (prompt_len, num_decodes, budget, fixed_ms, per_token_ms).
PredictCase = tuple[int, int, int, float, float]


def _predicted_ttft(
    prompt_len: int, num_decodes: int, budget: int, fixed_ms: float, per_token_ms: float
) -> tuple[int, float]:
    """The steps from a prompt's arrival to the step that computes its last prompt token, and their cost in ms,
    as the package's Scheduler schedules them beside ``num_decodes`` older requests that keep decoding."""
    sched = Scheduler(
        BlockManager(num_decodes * (prompt_len // 16 + 2) + prompt_len // 16 + 2, 16),
        max_num_batched_tokens=budget,
        watermark=0,
    )
    params = SamplingParams(max_new_tokens=prompt_len + 4, stop_token_ids=())  # decoding until the prompt is in
    for i in range(num_decodes):  # one-token prompts: decoding from their second step on
        sched.add(Sequence(f"decode {i}", [1], params))
    for _ in range(2):
        sched.advance_without_model(sched.schedule())
    sched.add(Sequence("long", [1] * prompt_len, SamplingParams(max_new_tokens=1, stop_token_ids=())))
    steps, tokens = 0, 0
    while True:
        out = sched.schedule()
        steps, tokens = steps + 1, tokens + sum(s.num_new_tokens for s in out.scheduled)
        if any(s.seq.seq_id == "long" and s.samples for s in out.scheduled):
            return steps, steps * fixed_ms + per_token_ms * tokens
        sched.advance_without_model(out)


def _predict_wrong(
    *case: float, chunk_full=False, no_decodes=False, one_fixed=False, floor=False, full_steps=False
) -> tuple[int, float]:
    p, d, b, f, t = case
    chunk = b if chunk_full else b - d
    steps = max(1, p // chunk) if floor else -(-p // chunk)
    tokens = steps * b if full_steps else p + (0 if no_decodes else steps * d)
    return steps, (f if one_fixed else steps * f) + t * tokens


def _same_prediction(got, want) -> bool:
    return got[0] == want[0] and math.isclose(got[1], want[1], rel_tol=1e-9, abs_tol=1e-9)


_PREDICT_MISTAKES = mistaken(
    _predict_wrong,
    chunk_full="The decodes go first: each step, the older requests' decode tokens come out of the budget, and the "
    "prompt's chunk gets what is left, budget - num_decodes.",
    no_decodes="The decodes share every step with the chunk: the steps feed the prompt's tokens and num_decodes decode "
    "tokens each, and the per-token cost counts them all.",
    one_fixed="Every step pays the fixed cost: steps * fixed_ms, not fixed_ms once.",
    floor="A partial chunk is a step too: ceil(prompt_len / chunk) steps, not floor.",
    full_steps="The last chunk is usually smaller than the others: count the tokens fed (the prompt, plus the decodes "
    "of every step), not steps * budget.",
)


def _predict_cases(rng) -> list[PredictCase]:
    cases: list[PredictCase] = [
        (1024, 4, 128, 56.0, 1.45),  # the chapter's run: nine chunks
        (1024, 4, 2048, 56.0, 1.45),  # the budget holds the whole prompt: one step
        (100, 0, 32, 10.0, 0.5),  # nobody decoding
        (124, 4, 128, 30.0, 1.0),  # exactly one full chunk
    ]
    while len(cases) < 24:
        d = rng.randint(0, 16)
        cases.append((rng.randint(1, 3000), d, rng.randint(d + 1, 1024), round(rng.uniform(5, 100), 1),
                      round(rng.uniform(0.05, 3), 2)))  # fmt: skip
    return cases


def _a_prediction(case: str, got, *_) -> tuple[int, float]:
    if not (
        isinstance(got, (tuple, list))
        and len(got) == 2
        and isinstance(got[0], int)
        and not isinstance(got[0], bool)
        and isinstance(got[1], (int, float))
    ):
        raise ExerciseError(
            f"{case} should return (steps, milliseconds): an int and a number, got {describe(got)}", case=case
        )
    return tuple(got)


@check(
    "check_predicted_ttft",
    takes="predict_ttft",
    references={"Scheduler": Scheduler},
    task="predict from the rules, without running a scheduler.",
)
def check_predicted_ttft(
    predict_ttft: Callable[[int, int, int, float, float], tuple[int, float]], seed: int = 0
) -> CheckResult:
    """``predict_ttft(prompt_len, num_decodes, budget, fixed_ms, per_token_ms) -> (steps, ms)``: from a prompt's
    arrival to the step that computes its last prompt token, beside ``num_decodes`` older requests that keep
    decoding, with chunked prefill under ``budget`` tokens a step, each step costing ``fixed_ms + per_token_ms *
    tokens``. Compared with the package's Scheduler driven without a model."""
    diagnose(
        predict_ttft,
        _predict_cases(hidden_rng()),
        label=lambda *case: f"predict_ttft{case}",
        reference=_predicted_ttft,
        mistakes=_PREDICT_MISTAKES,
        hint="Each step feeds num_decodes decode tokens and a chunk of budget - num_decodes prompt tokens (the last "
        "one smaller); count the steps, the tokens fed, and charge fixed_ms per step plus per_token_ms per token.",
        compare=_same_prediction,
        returns=_a_prediction,
    )
    steps, ms = _predicted_ttft(1024, 4, 128, 56.0, 1.45)
    return passed(
        f"a 1,024-token prompt beside 4 decodes with a budget of 128 takes {steps} steps: "
        f"{ms / 1e3:.2f} s at 56 ms + 1.45 ms per token."
    )
