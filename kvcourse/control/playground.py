"""The playground: the real scheduler and block manager, stepped one ``schedule()`` call at a time.

The book's pages (chapters 4, 6 and 7) run this module in the reader's browser, under Pyodide: the widget
(``_static/kvplay.js``) builds a :class:`Playground` from the reader's choices, calls :meth:`Playground.step`
at each click and draws what it returns. Nothing here is a model of the scheduler: it is
:class:`~kvcourse.serving.Scheduler` and :class:`~kvcourse.paged.BlockManager` (or
:class:`~kvcourse.paged.PrefixCachingBlockManager`), the code chapter 6's engine runs between two forwards,
driven as :meth:`Scheduler.advance_without_model` drives it (placeholder tokens: the decisions do not depend on
them). Each step also says which lines of ``scheduler.py`` ran (``sys.settrace``), and links every decision
to the line that made it.

Standard library only, like the rest of :mod:`kvcourse.control`.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from ..checks import check_bool, check_choice, check_int
from ..paged.block_manager import BlockManager
from ..paged.prefix_cache import PrefixCachingBlockManager
from ..sequence import SamplingParams, Sequence
from ..serving import scheduler as _scheduler_module
from ..serving.scheduler import Scheduler, SchedulerOutput

__all__ = [
    "ARRIVALS",
    "PRESETS",
    "SYSTEM_PROMPT_BLOCKS",
    "Playground",
    "PlaygroundConfig",
    "count_steps",
    "scheduler_source",
]

ARRIVALS = {
    "burst": "every request at step 0",
    "steady": "one request every 2 steps",
    "shared prompt": "one every 2 steps, all starting with the same system prompt (SYSTEM_PROMPT_BLOCKS blocks)",
}


@dataclass(frozen=True)
class PlaygroundConfig:
    """The reader's choices. ``token_budget`` is ``max_num_batched_tokens``, the most tokens one step feeds:
    the chunk a long prompt is cut into. ``preemption``: ``"recompute"`` or ``"swap"`` (a host pool of half the
    GPU pool's blocks). ``samples``: ``n``, samples per request, which share the prompt's blocks (copy-on-write).
    """

    block_size: int = 4
    num_blocks: int = 24
    num_requests: int = 6
    arrival: str = "burst"
    token_budget: int = 16
    max_num_seqs: int = 4
    chunked_prefill: bool = True
    preemption: str = "recompute"
    prefix_caching: bool = False
    samples: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, min=1, max=64)
        check_int("num_blocks", self.num_blocks, min=1, max=256)
        check_int("num_requests", self.num_requests, min=1, max=32)
        check_choice("arrival", self.arrival, tuple(ARRIVALS))
        check_int("token_budget", self.token_budget, min=1, max=4096)
        check_int("max_num_seqs", self.max_num_seqs, min=1, max=64)
        check_bool("chunked_prefill", self.chunked_prefill)
        check_choice("preemption", self.preemption, ("recompute", "swap"))
        check_bool("prefix_caching", self.prefix_caching)
        check_int("samples", self.samples, min=1, max=4)
        check_int("seed", self.seed, min=0)

    @classmethod
    def from_json(cls, text: str) -> PlaygroundConfig:
        """From the widget's form, as JSON; an unknown field is an error that names it."""
        values = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown playground settings {unknown}; known: {sorted(known)}")
        return cls(**values)


# What each chapter's page opens with: the idea the chapter is about, visible within a few steps.
PRESETS = {
    "04": PlaygroundConfig(block_size=4, num_blocks=16, num_requests=5, arrival="burst", token_budget=64,
                           max_num_seqs=8),  # the pool fills, tables grow a block at a time, one preemption
    "06": PlaygroundConfig(block_size=4, num_blocks=12, num_requests=6, arrival="steady", token_budget=12,
                           max_num_seqs=4, seed=1),  # chunked prefill beside decodes, preemption when the pool runs dry
    "07": PlaygroundConfig(block_size=4, num_blocks=24, num_requests=6, arrival="shared prompt", token_budget=16,
                           max_num_seqs=4, prefix_caching=True, samples=2),  # cache hits, shared blocks
}  # fmt: skip


SYSTEM_PROMPT_BLOCKS = 2  # "shared prompt" arrivals: every prompt starts with this many blocks of the same tokens


def _workload(config: PlaygroundConfig) -> list[tuple[int, list[int], int]]:
    """``(arrival step, prompt tokens, max_new_tokens)`` per request, from ``config.seed`` alone."""
    rng = random.Random(config.seed)
    system = [rng.randrange(1, 1000) for _ in range(SYSTEM_PROMPT_BLOCKS * config.block_size)]
    requests = []
    for i in range(config.num_requests):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(3, 14))]
        if config.arrival == "shared prompt":
            prompt = system + prompt
        arrives = 0 if config.arrival == "burst" else 2 * i
        requests.append((arrives, prompt, rng.randint(3, 10)))
    return requests


# ---- the lines of scheduler.py a decision comes from --------------------------------------------------
# Each anchor is one line of scheduler.py, found by its text (exactly once, or import fails: a test keeps them
# true), so a decision links to the line that made it, whatever the line numbers become.
_ANCHORS = {
    "run": "if self._reserve(seq, n, out):",
    "cow": "out.copies.append(cow)",
    "swap out": "self.block_manager.swap_out(seq.seq_id)",
    "recompute": "self._recompute(seq)",
    "swap in": "bm.swap_in(seq.seq_id)",
    "run swapped in": "self._reserve(seq, n, out)  # cannot preempt: the blocks were counted above",
    "admit": "self._start(self.waiting.popleft(), out.admitted)",
    "no room": "if admission is None:",
    "no seat": "if self._seats_used() + self._seats(seq) > self.max_num_seqs:",
    "no budget": "while self.waiting and budget > 0:",
    "after preemption": "if not out.preempted:  # a step that had to preempt takes nobody in: the pool is too tight",
    "swapped first": "if not self.swapped:  # the swapped-out sequences came first",
}
_FUNCTIONS = ("schedule", "_schedule_running", "_schedule_swapped", "_schedule_waiting", "_reserve", "_preempt")


_SCHEDULER_FILE = _scheduler_module.__file__  # the frames the line trace follows


def _anchor_lines() -> dict[str, int]:
    lines = Path(_SCHEDULER_FILE).read_text(encoding="utf-8").splitlines()
    found = {}
    for key, text in _ANCHORS.items():
        hits = [i + 1 for i, line in enumerate(lines) if line.strip() == text]
        if len(hits) != 1:
            raise RuntimeError(
                f"the playground's anchor {key!r} ({text!r}) is in scheduler.py {len(hits)} times, not once"
            )
        found[key] = hits[0]
    return found


LINES = _anchor_lines()


def scheduler_source() -> dict:
    """The scheduling methods of ``scheduler.py`` with their line numbers, for the widget's source panel."""
    import inspect

    out = []
    for name in _FUNCTIONS:
        text, start = inspect.getsourcelines(getattr(Scheduler, name))
        out.append({"name": name, "start": start, "lines": [t.rstrip("\n") for t in text]})
    return {"file": "kvcourse/serving/scheduler.py", "functions": out, "anchors": LINES}


class _LineTrace:
    """The lines of ``scheduler.py`` that run inside a call, in order (``sys.settrace``, this thread only)."""

    def __init__(self) -> None:
        self.lines: list[int] = []

    def _trace(self, frame, event, arg):
        if frame.f_code.co_filename != _SCHEDULER_FILE:
            return None  # do not trace inside other modules' frames
        if event == "line":
            self.lines.append(frame.f_lineno)
        return self._trace

    def __call__(self, fn):
        previous = sys.gettrace()
        sys.settrace(self._trace)
        try:
            return fn()
        finally:
            sys.settrace(previous)


def _name(seq: Sequence | tuple[int, int]) -> str:
    request, sample = seq if isinstance(seq, tuple) else seq.seq_id
    return f"r{request}" if sample == 0 else f"r{request}.{sample}"


class Playground:
    """One run of the control plane on a generated workload, stepped by :meth:`step`.

    Example::

        pg = Playground(PRESETS["06"])
        while not pg.done:
            record = pg.step()   # what the widget draws: decisions, pool, tables, queues, budget, lines
    """

    def __init__(self, config: PlaygroundConfig | None = None) -> None:
        if config is None:
            config = PlaygroundConfig()
        if not isinstance(config, PlaygroundConfig):
            raise TypeError(f"config must be a PlaygroundConfig, got {type(config).__name__}")
        self.config = c = config
        host = c.num_blocks // 2 if c.preemption == "swap" else 0
        manager = PrefixCachingBlockManager if c.prefix_caching else BlockManager
        self.block_manager = manager(c.num_blocks, c.block_size, num_host_blocks=host)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.token_budget,
                                   enable_chunked_prefill=c.chunked_prefill, watermark=0.0,
                                   preemption_mode=c.preemption)  # fmt: skip
        self.pending = [
            (arrives, Sequence((i, 0), prompt, SamplingParams(max_new_tokens=new, stop_token_ids=(), n=c.samples)))
            for i, (arrives, prompt, new) in enumerate(_workload(c))
        ]
        for _, seq in self.pending:  # refuse a request that could never run now, before step 0, naming it
            self.scheduler.check(seq, name=f"request r{seq.seq_id[0]} ({seq.num_prompt_tokens} prompt tokens)")
        self.step_index = 0

    @property
    def done(self) -> bool:
        return not self.pending and not self.scheduler.has_unfinished()

    def step(self) -> dict:
        """Queue the requests that arrive now, run one ``schedule()``, finish the step without a model."""
        if self.done:
            raise RuntimeError("the playground has finished every request: reset it to start again")
        arrived = []
        while self.pending and self.pending[0][0] <= self.step_index:
            seq = self.pending.pop(0)[1]
            self.scheduler.add(seq)
            arrived.append(_name(seq))
        trace = _LineTrace()
        out = trace(self.scheduler.schedule)
        decisions = self._decisions(out, trace.lines)
        self.scheduler.advance(out)
        sampled = {}
        for s in out.scheduled:
            if not s.samples:
                continue
            seq = s.seq
            if seq.num_tokens == seq.num_prompt_tokens:  # its first token: the other samples fork here (engine's rule)
                for k in range(1, seq.params.n):
                    child = seq.fork((seq.seq_id[0], k))
                    self.scheduler.fork(seq, child)
                    sampled[child.seq_id] = 0
                    decisions.append(
                        {
                            "text": f"{_name(child)} forks from {_name(seq)}: it shares its "
                            f"{len(self.block_manager.block_table(seq.seq_id))} blocks",
                            "line": None,
                        }
                    )
            sampled[seq.seq_id] = 0
        finished = self.scheduler.append_tokens(sampled)
        record = {
            "step": self.step_index,
            "arrived": arrived,
            "scheduled": [
                [_name(s.seq), s.kind, s.num_computed_tokens, s.num_new_tokens, s.num_cached_tokens]
                for s in out.scheduled
            ],
            "decisions": decisions,
            "budget": {"used": out.num_batched_tokens, "limit": self.config.token_budget},
            "lines": sorted(set(trace.lines)),
            "finished": [_name(s) for s in finished],
            **self.state(),
        }
        self.step_index += 1
        return record

    def run(self, max_steps: int = 1000) -> list[dict]:
        """Every step to the end (``max_steps`` guards a run that would never finish)."""
        max_steps = check_int("max_steps", max_steps, min=1)
        records = []
        while not self.done:
            if len(records) == max_steps:
                raise RuntimeError(f"the playground did not finish in max_steps={max_steps} steps")
            records.append(self.step())
        return records

    def step_json(self) -> str:
        return json.dumps(self.step())

    def state_json(self) -> str:
        """:meth:`state` as JSON: what the widget draws before the first step (every request not arrived yet)."""
        return json.dumps(self.state())

    def state(self) -> dict:
        """The pool block by block, each sequence's block table, the queues."""
        bm, sched = self.block_manager, self.scheduler
        cached = getattr(bm, "cached_block", lambda b: None)
        pool = []
        for b in range(bm.num_blocks):
            refs = bm.ref_count(b)
            kind = "shared" if refs > 1 else "used" if refs else "cached" if cached(b) is not None else "free"
            pool.append([kind, refs])
        owners: dict[str, list[str]] = {}
        for seq_id in bm.seq_ids:
            for b in bm.block_table(seq_id):
                owners.setdefault(str(b), []).append(_name(seq_id))
        # The host tier's blocks by id: its bookkeeping has no public view of them, so read it here.
        host = ["free"] * bm.host.num_blocks
        swapped_tables = {seq_id: blocks for seq_id, (blocks, _) in bm._swapped.items()}
        for blocks in swapped_tables.values():
            for b in blocks:
                host[b] = "swapped"
        for b in bm.host._cold:
            host[b] = "cold"
        seqs = [*sched.running, *sched.swapped, *sched.waiting]
        return {
            "pool": pool,
            "owners": owners,
            "host": host,
            "tables": {_name(s): bm.block_table(s.seq_id) if s.seq_id in bm else [] for s in seqs},
            "host_tables": {_name(seq_id): blocks for seq_id, blocks in swapped_tables.items()},
            "progress": {_name(s): [s.num_computed_tokens, s.num_tokens, s.num_prompt_tokens] for s in seqs},
            "running": [_name(s) for s in sched.running],
            "waiting": [_name(s) for s in sched.waiting],
            "swapped": [_name(s) for s in sched.swapped],
            "not_arrived": [_name(s) for _, s in self.pending],
        }

    def _decisions(self, out: SchedulerOutput, lines: list[int]) -> list[dict]:
        """What the step decided, in words, each with the line of ``schedule()`` (or a helper) that decided it."""
        said = []
        for victim in out.preempted:  # linked to where _preempt chose swap or recompute for it
            if victim in out.swapped_out:
                said.append({"text": f"{_name(victim)} preempted: swapped to the host pool", "line": LINES["swap out"]})
            else:
                said.append({"text": f"{_name(victim)} preempted: its blocks freed, to recompute later",
                             "line": LINES["recompute"]})  # fmt: skip
        for seq in out.swapped_in:
            said.append({"text": f"{_name(seq)} swapped back in", "line": LINES["swap in"]})
        admitted, swapped_in = {id(s) for s in out.admitted}, {id(s) for s in out.swapped_in}
        for s in out.scheduled:
            what = {
                "decode": "decodes 1 token",
                "prefill": f"prefills {s.num_new_tokens} tokens",
                "chunk": f"feeds a chunk of {s.num_new_tokens} prompt tokens",
                "recompute": f"recomputes {s.num_new_tokens} tokens",
            }[s.kind]
            if s.num_cached_tokens:
                what += f" after {s.num_cached_tokens} from the prefix cache"
            if id(s.seq) in admitted:
                said.append({"text": f"{_name(s.seq)} admitted: {what}", "line": LINES["admit"]})
            else:
                line = LINES["run swapped in" if id(s.seq) in swapped_in else "run"]
                said.append({"text": f"{_name(s.seq)} {what}", "line": line})
        for cow in out.copies:
            said.append({"text": f"copy-on-write: block {cow.src_block} copied to block {cow.dst_block} before the write",
                         "line": LINES["cow"]})  # fmt: skip
        waiting = self.scheduler.waiting
        if waiting:  # why the head of the queue still waits: the check of schedule() that ran last
            reasons = {
                "after preemption": "the step preempted, so it admits nobody",
                "swapped first": "swapped-out sequences come back first",
                "no seat": f"max_num_seqs={self.config.max_num_seqs} seats are taken",
                "no room": "the pool has no room for its blocks",
                "no budget": "the step's token budget is spent",
            }
            by_line = {LINES[key]: key for key in reasons}
            ran = [by_line[line] for line in lines if line in by_line]
            if ran:
                said.append({"text": f"{_name(waiting[0])} waits: {reasons[ran[-1]]}", "line": LINES[ran[-1]]})
        return said


def new(config_json: str = "{}") -> Playground:
    """The widget's entry point: a playground from the form's JSON."""
    return Playground(PlaygroundConfig.from_json(config_json))


def count_steps(config_json: str = "{}") -> int:
    """How many steps a run on these settings takes to finish every request: the widget's "step k of N"."""
    return len(new(config_json).run())
