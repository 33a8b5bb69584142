"""Checks for chapter 6's scheduler exercises: the learner writes the two phases of a step.

1. :func:`check_schedule_running` -- phase 1: the running sequences, oldest first, each ``min(its uncomputed
   tokens, budget left)``, their slots reserved from the free blocks, the newest giving way while the pool is short.
2. :func:`check_schedule_waiting` -- phase 2: admission, head of the queue first, a chunk when the budget is short,
   while the budget, the seats and the free blocks last, nobody overtaking.

Both run on the chapter's step-by-step harness. The learner's function decides on plain data (a list of dicts: the
grader calls it in another process, where a ``Sequence`` cannot be lent), and the check plugs it into a
:class:`~kvcourse.serving.Scheduler` in place of the package's own phase: it applies the decisions with the block
manager's calls, which refuse any that the pool cannot hold. Then it drives that scheduler and the package's
``Scheduler.schedule()`` through hidden traces without a model, step by step, and compares what each step runs,
admits and preempts, and the free blocks after it. Wrong answers are compared with the typical mistakes
(:class:`~kvcourse.exercises._core.Diagnosis`); ``tests/test_exercises_ch06_phases.py`` proves each hint.
"""

from __future__ import annotations

from collections.abc import Callable

from ..paged import BlockManager, NoFreeBlocksError
from ..sequence import SamplingParams, Sequence
from ..serving.scheduler import Scheduler, SchedulerOutput
from ._core import CheckResult, Diagnosis, ExerciseError, call_learner, check, describe, hidden_rng, passed

__all__ = ["check_schedule_running", "check_schedule_waiting"]

# A trace: (prompt_lens, max_new_tokens, num_blocks, block_size, max_num_batched_tokens, max_num_seqs).
Trace = tuple[tuple[int, ...], int, int, int, int, int]
_MAX_STEPS = 2000  # every trace finishes in under 200 steps with a right phase


class _Refused(ExerciseError):
    """The block manager refused a decision (the pool had no room): the trace stops there."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# --- the learner's phase inside a Scheduler --------------------------------------------------------
class _LearnerPhase(Scheduler):
    """A Scheduler that asks ``decide`` (the learner's function) for one phase of each step."""

    def __init__(self, decide: Callable, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.decide = decide


class _Running(_LearnerPhase):
    """Phase 1 is ``decide(running, budget, free_blocks, block_size) -> (scheduled, preempted)``."""

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        views = [dict(seq_id=s.seq_id, num_tokens=s.num_tokens, num_computed_tokens=s.num_computed_tokens,
                      num_blocks=len(bm.block_table(s.seq_id))) for s in self.running]  # fmt: skip
        shown = (
            f"schedule_running({views}, budget={budget}, free_blocks={bm.num_free_blocks}, block_size={bm.block_size})"
        )
        got = self.decide([dict(v) for v in views], budget, bm.num_free_blocks, bm.block_size)
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, list) for x in got)):
            raise ExerciseError(
                f"{shown} returned {describe(got)}: return a tuple (scheduled, preempted) of two "
                f"lists, [(seq_id, num_tokens), ...] and [seq_id, ...]"
            )
        scheduled, preempted = got
        by_id = {s.seq_id: s for s in self.running}
        if len(set(preempted)) != len(preempted) or not all(p in by_id for p in preempted):
            raise ExerciseError(f"{shown}: preempted {preempted} must name running sequences, each once")
        pairs = _pairs(scheduled, shown)
        for seq_id, n in pairs:
            seq = by_id.get(seq_id)
            if seq is None or seq_id in preempted or sum(1 for s, _ in pairs if s == seq_id) > 1:
                raise ExerciseError(
                    f"{shown}: scheduled {scheduled} must name running sequences that were not preempted, each once"
                )
            if not 1 <= n <= seq.num_uncomputed_tokens:
                raise ExerciseError(
                    f"{shown}: sequence {seq_id} was given {n} tokens; it has "
                    f"{seq.num_uncomputed_tokens} not computed yet"
                )
        for seq_id in preempted:  # in the order they gave way: the last one ends up at the head of the queue
            seq = by_id[seq_id]
            self.running.remove(seq)
            self._recompute(seq)
            out.preempted.append(seq)
        for seq_id, n in pairs:
            try:
                self.block_manager.append_slots(seq_id, n)
            except NoFreeBlocksError:
                raise _Refused(
                    f"sequence {seq_id} was given {n} new tokens, which need "
                    f"{self.block_manager.blocks_to_append(seq_id, n)} more blocks, but after the "
                    f"preemptions {preempted} only {self.block_manager.num_free_blocks} were free: count "
                    f"the blocks it needs, and preempt until they are free"
                ) from None
            out.scheduled.append(self._scheduled(by_id[seq_id], n))
        return budget - sum(n for _, n in pairs)


class _Waiting(_LearnerPhase):
    """Admission is ``decide(waiting, budget, free_blocks, block_size, seats) -> admitted``."""

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        views = [dict(seq_id=s.seq_id, num_tokens=s.num_tokens) for s in self.waiting]
        seats = self.max_num_seqs - len(self.running)
        shown = (
            f"schedule_waiting({views}, budget={budget}, free_blocks={bm.num_free_blocks}, "
            f"block_size={bm.block_size}, seats={seats})"
        )
        got = self.decide([dict(v) for v in views], budget, bm.num_free_blocks, bm.block_size, seats)
        if not isinstance(got, list):
            raise ExerciseError(f"{shown} returned {describe(got)}: return a list [(seq_id, num_tokens), ...]")
        pairs = _pairs(got, shown)
        by_id = {s.seq_id: s for s in self.waiting}
        for seq_id, n in pairs:
            seq = by_id.pop(seq_id, None)
            if seq is None:
                raise ExerciseError(f"{shown}: admitted {got} must name waiting sequences, each once")
            if not 1 <= n <= seq.num_tokens:
                raise ExerciseError(f"{shown}: sequence {seq_id} was admitted with {n} tokens; it has {seq.num_tokens}")
            try:
                bm.allocate(seq_id, n)
            except NoFreeBlocksError:
                raise _Refused(
                    f"sequence {seq_id} was admitted with {n} tokens, which need {bm.blocks_needed(n)} "
                    f"blocks, but only {bm.num_free_blocks} were free: check the blocks before "
                    f"admitting"
                ) from None
            self.waiting.remove(seq)
            self._start(seq, out.admitted)
            out.scheduled.append(self._scheduled(seq, n))


def _pairs(pairs: object, shown: str) -> list[tuple[object, int]]:
    ok = isinstance(pairs, list) and all(
        isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[1], int) and not isinstance(p[1], bool)
        for p in pairs
    )
    if not ok:
        raise ExerciseError(
            f"{shown}: scheduled tokens must be a list of (seq_id, num_tokens) pairs, got {describe(pairs)}"
        )
    return [(p[0], p[1]) for p in pairs]


def _scheduler(trace: Trace, cls: type | None = None, decide: Callable | None = None) -> Scheduler:
    prompt_lens, max_new, num_blocks, block_size, budget, max_num_seqs = trace
    kwargs = dict(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, watermark=0)
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, **kwargs) if cls is None else cls(decide, bm, **kwargs)
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=())
    for i, n in enumerate(prompt_lens):
        sched.add(Sequence(i, [1] * n, params))
    return sched


def _log(trace: Trace, cls: type | None = None, decide: Callable | None = None) -> list[tuple]:
    """Each step of ``trace``: ``(scheduled [(seq_id, computed, new tokens)], admitted, preempted, free blocks)``."""
    sched, log = _scheduler(trace, cls, decide), []
    while sched.has_unfinished():
        if len(log) == _MAX_STEPS:
            raise ExerciseError(
                f"trace {trace} did not finish in {_MAX_STEPS} steps: some step schedules nothing, "
                f"or the requests keep preempting each other",
                case=str(trace),
            )
        try:
            out = sched.schedule()
        except _Refused as refused:  # the learner's decision did not fit the pool: the trace ends here
            log.append(("refused", str(refused)))
            break
        log.append(
            (
                [(s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled],
                [s.seq_id for s in out.admitted],
                [s.seq_id for s in out.preempted],
                sched.block_manager.num_free_blocks,
            )
        )
        if not out.scheduled and not out.preempted:  # nothing moves: every later step would be the same
            break
        sched.advance_without_model(out)
    return log


def _show(step: int, entry: tuple | None) -> str:
    if entry is None:
        return f"step {step}: nothing (every request had finished)"
    if entry[0] == "refused":
        return f"step {step}: {entry[1]}"
    ran, admitted, preempted, free = entry
    if not ran and not preempted:
        return f"step {step} runs nothing, admits nobody, and requests are still waiting: the engine would stop here"
    runs = ", ".join(f"{i}: {n} token{'s' if n > 1 else ''} from {c}" for i, c, n in ran) or "nothing"
    return f"step {step} runs {{{runs}}}, admits {admitted}, preempts {preempted}, leaves {free} blocks free"


class _Run:
    """A learner's whole log, shown in a failure message by its first step that differs."""

    def __init__(self, log: list[tuple], want: list[tuple]) -> None:
        self.log = log
        self.step = next((i for i, (a, b) in enumerate(zip(log, want)) if a != b), min(len(log), len(want)))

    def __repr__(self) -> str:
        return _show(self.step, self.log[self.step] if self.step < len(self.log) else None)


def _same_run(run: _Run, wrong: list[tuple]) -> bool:
    return run.log == wrong


def _compare(name: str, decide: Callable, cls: type, traces: list[Trace], diagnosis: Diagnosis) -> None:
    """Each trace through the learner's phase and through ``Scheduler.schedule()``; the first step that differs."""
    for trace in traces:
        want = _log(trace)
        got = _log(trace, cls, lambda *a: call_learner(name, decide, *a))
        if got != want:
            run = _Run(got, want)
            step = run.step
            diagnosis.record(
                f"trace (prompt_lens, max_new_tokens, num_blocks, block_size, budget, max_num_seqs) = {trace}, "
                f"step {step}",
                (trace,),
                run,
                _show(step, want[step] if step < len(want) else None),
            )
    diagnosis.raise_if_wrong()


# --- Exercise: phase 1, the running sequences' slots ------------------------------------------------
def _running(
    running,
    budget,
    free_blocks,
    block_size,
    *,
    min_budget=True,
    newest_first=False,
    one_token=False,
    victim_asks=False,
    victim_frees=True,
    fresh_blocks=False,
):
    """Phase 1 as vLLM and the package do it (every flag False/True as given), or a typical mistake."""
    order = list(reversed(running)) if newest_first else list(running)
    scheduled, preempted, gone = [], [], set()
    for i, seq in enumerate(order):
        if budget <= 0:
            break
        if seq["seq_id"] in gone:
            continue
        left = seq["num_tokens"] - seq["num_computed_tokens"]
        n = 1 if one_token else min(left, budget) if min_budget else left
        need = (
            _ceil(n, block_size)
            if fresh_blocks
            else max(0, _ceil(seq["num_computed_tokens"] + n, block_size) - seq["num_blocks"])
        )
        while need > free_blocks:
            rest = [s for s in order[i:] if s["seq_id"] not in gone]
            victim = rest[0] if victim_asks else rest[-1]
            gone.add(victim["seq_id"])
            preempted.append(victim["seq_id"])
            free_blocks += victim["num_blocks"] if victim_frees else 0
            if victim is seq:
                break
        if seq["seq_id"] in gone:
            continue
        free_blocks -= need
        scheduled.append((seq["seq_id"], n))
        budget -= n
    return scheduled, preempted


def _running_wrong(**flags) -> Callable[[Trace], list[tuple]]:
    return lambda trace: _log(trace, _Running, lambda *a: _running(*a, **flags))


_RUNNING_MISTAKES = [
    (
        "A chunk past the budget: a sequence gets min(its uncomputed tokens, budget left), never more. A running "
        "request still prefilling a long prompt would otherwise feed all of it in one step, past "
        "max_num_batched_tokens, and every decode behind it would wait for that long step (decodes starved by a "
        "long prefill).",
        _running_wrong(min_budget=False),
    ),
    (
        "Oldest first: walk the running sequences in their order (the oldest first), so an old request is never "
        "squeezed out of the budget by newer ones.",
        _running_wrong(newest_first=True),
    ),
    (
        "Not every running sequence is decoding: one admitted with a chunk of its prompt still has prompt tokens to "
        "compute. Give each min(its uncomputed tokens, budget left), not one token.",
        _running_wrong(one_token=True),
    ),
    (
        "The victim is the newest running sequence (the last one still in the list), not the one that asks for the "
        "block: preempting the one that asks lets newer requests push older ones out, and the oldest may starve.",
        _running_wrong(victim_asks=True),
    ),
    (
        "A preempted sequence gives its blocks back: add its num_blocks to the free blocks before you check again.",
        _running_wrong(victim_frees=False),
    ),
    (
        "The last block a sequence holds may be partly empty: its new tokens fill it first. It needs "
        "ceil((num_computed_tokens + n) / block_size) - num_blocks new blocks, not ceil(n / block_size).",
        _running_wrong(fresh_blocks=True),
    ),
]


def _running_traces(rng) -> list[Trace]:
    traces: list[Trace] = [
        ((3, 20, 6), 4, 32, 4, 16, 8),  # the chapter's first example: a chunk, then decodes and the second chunk
        ((6, 5, 7), 10, 7, 4, 16, 8),  # the chapter's pool too small for three: preemption
        ((30, 5, 18, 9), 16, 17, 4, 64, 8),
        ((40, 4, 4, 4), 12, 16, 4, 24, 8),  # a long prompt in chunks beside short ones
    ]
    while len(traces) < 12:
        k, bs, max_new = rng.randint(3, 6), rng.choice([2, 4, 8]), rng.randint(3, 14)
        lens = tuple(rng.randint(1, 40) for _ in range(k))
        need = _ceil(max(lens) + max_new - 1, bs)  # the biggest request must fit alone
        traces.append((lens, max_new, rng.randint(need, need + 8), bs, rng.choice([8, 16, 32, 64]), rng.randint(2, 6)))
    return traces


@check(
    "check_schedule_running",
    takes="schedule_running",
    references={"Scheduler": Scheduler, "BlockManager": BlockManager},
    task="do the block arithmetic yourself.",
)
def check_schedule_running(schedule_running: Callable, seed: int = 0) -> CheckResult:
    """``schedule_running(running, budget, free_blocks, block_size) -> (scheduled, preempted)``: phase 1 of a step.

    ``running``: the running sequences, oldest first, each a dict of ``seq_id``, ``num_tokens``,
    ``num_computed_tokens`` and ``num_blocks`` (blocks it holds). ``scheduled``: ``[(seq_id, num_tokens), ...]`` in
    the order they run; ``preempted``: the seq_ids that gave way, in the order they did. Plugged into a Scheduler
    and compared with ``Scheduler.schedule()`` step by step on hidden traces."""
    diagnosis = Diagnosis(
        _RUNNING_MISTAKES,
        same=_same_run,
        default=(
            "Walk the running sequences oldest first: each gets min(its uncomputed tokens, budget left) and needs "
            "ceil((num_computed_tokens + n) / block_size) - num_blocks new blocks; while they are not free, the newest "
            "still running gives way (its blocks come back), and if that is the sequence itself, it is skipped."
        ),
    )
    traces = _running_traces(hidden_rng())
    _compare("schedule_running", schedule_running, _Running, traces, diagnosis)
    return passed(
        f"phase 1 made the package's decisions at every step of {len(traces)} hidden traces: oldest first, "
        f"min(uncomputed, budget left), and the newest gave way when the blocks ran out."
    )


# --- Exercise: phase 2, admission -------------------------------------------------------------------
def _waiting(
    waiting,
    budget,
    free_blocks,
    block_size,
    seats,
    *,
    overtake=False,
    chunked=True,
    whole=False,
    prompt_blocks=False,
    seat_cap=True,
    round_down=False,
    reserve=0,
):
    """Admission as vLLM and the package do it with chunked prefill, or a typical mistake."""
    admitted = []
    for seq in waiting:
        if budget <= 0 or (seat_cap and seats <= 0):
            break
        total = seq["num_tokens"]
        if whole and total > budget:
            break  # no chunked prefill: the whole prompt or nothing
        n = min(total, budget) if chunked else total
        need = (
            (total if prompt_blocks else n) // block_size
            if round_down
            else _ceil(total if prompt_blocks else n, block_size)
        )
        if need > free_blocks - reserve:
            if overtake:
                continue
            break
        admitted.append((seq["seq_id"], n))
        budget, free_blocks, seats = budget - n, free_blocks - need, seats - 1
    return admitted


def _waiting_wrong(**flags) -> Callable[[Trace], list[tuple]]:
    return lambda trace: _log(trace, _Waiting, lambda *a: _waiting(*a, **flags))


_WAITING_MISTAKES = [
    (
        "A waiting request admitted before an older one: when the request at the head does not fit, admission stops. "
        "A smaller request behind it must not overtake, or a big request could wait forever.",
        _waiting_wrong(overtake=True),
    ),
    (
        "A chunk past the budget: a request is admitted with min(its tokens, budget left) tokens, never more; the "
        "budget is what the running sequences left, not the whole max_num_batched_tokens.",
        _waiting_wrong(chunked=False),
    ),
    (
        "Chunked prefill: a prompt longer than the budget left is admitted with a chunk of the budget left; the rest of "
        "it runs in later steps. Stopping at it wastes the step's budget.",
        _waiting_wrong(whole=True),
    ),
    (
        "The chunk needs blocks for its own tokens only, ceil(n / block_size): the rest of the prompt gets its blocks "
        "when its later chunks run.",
        _waiting_wrong(prompt_blocks=True),
    ),
    (
        "Seats: each admitted request takes one of the seats left (max_num_seqs less the running sequences); stop "
        "when none is left.",
        _waiting_wrong(seat_cap=False),
    ),
    (
        "Blocks are whole: n tokens need ceil(n / block_size) blocks, the last one partly empty.",
        _waiting_wrong(round_down=True),
    ),
    # the exercise states the watermark (none); a learner who keeps one back anyway is told so
    (
        "No watermark here: the check runs the scheduler with watermark=0, so a request may take every free block "
        "(it fits when its blocks <= free_blocks). Keeping blocks back admits fewer requests than the scheduler does.",
        _waiting_wrong(reserve=1),
    ),
]


def _waiting_traces(rng) -> list[Trace]:
    traces: list[Trace] = [
        ((3, 20, 6), 4, 32, 4, 16, 8),  # the chapter's first example: a chunk, then the rest
        ((40, 5, 5, 5), 6, 14, 4, 64, 8),  # blocks stop the 40 at first; the 5s must not overtake
        ((10, 10, 10, 10, 10), 4, 40, 4, 64, 2),  # two seats
        ((50, 3), 4, 20, 4, 32, 8),  # a chunk of 32 needs 8 blocks, not the prompt's 13
    ]
    while len(traces) < 12:
        k, bs, max_new = rng.randint(3, 7), rng.choice([2, 4, 8]), rng.randint(2, 10)
        lens = tuple(rng.randint(1, 60) for _ in range(k))
        need = _ceil(max(lens) + max_new - 1, bs)
        traces.append(
            (lens, max_new, rng.randint(need, 2 * need + 4), bs, rng.choice([8, 16, 32, 64]), rng.randint(2, 6))
        )
    return traces


@check(
    "check_schedule_waiting",
    takes="schedule_waiting",
    references={"Scheduler": Scheduler, "BlockManager": BlockManager},
    task="walk the queue yourself.",
)
def check_schedule_waiting(schedule_waiting: Callable, seed: int = 0) -> CheckResult:
    """``schedule_waiting(waiting, budget, free_blocks, block_size, seats) -> admitted``: phase 2 of a step.

    ``waiting``: the queue, head first, each a dict of ``seq_id`` and ``num_tokens`` (the tokens it has to prefill: a
    preempted request recomputes its generated tokens too). ``budget``: what the running sequences left.
    ``admitted``: ``[(seq_id, num_tokens), ...]`` in admission order. Plugged into a Scheduler and compared with
    ``Scheduler.schedule()`` step by step on hidden traces."""
    diagnosis = Diagnosis(
        _WAITING_MISTAKES,
        same=_same_run,
        default=(
            "Walk the queue head first while budget and seats are left: each request gets n = min(its tokens, budget "
            "left) and needs ceil(n / block_size) free blocks; the first that does not fit stops admission."
        ),
    )
    traces = _waiting_traces(hidden_rng())
    _compare("schedule_waiting", schedule_waiting, _Waiting, traces, diagnosis)
    return passed(
        f"admission made the package's decisions at every step of {len(traces)} hidden traces: head first, "
        f"a chunk when the budget is short, no overtaking."
    )
