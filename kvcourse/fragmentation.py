"""Fragmentation, measured: a request-trace simulator for KV-cache allocation strategies.

A server has a fixed pool of KV memory, counted in **token slots** (one slot holds
one token's K and V in every layer). Requests arrive over time; each has a prompt
and an output length that the server does not know in advance. Every simulated
**step** is one decoding iteration (Orca-style iteration-level scheduling): every
running request produces one token, new requests are admitted first come, first
served (FCFS), finished ones release their memory.

What differs is how memory is handed out (``strategy``):

* ``"max"``    -- reserve ``max_len`` slots per request, contiguous (the static pools
  of pre-paging servers; the vLLM paper's *Orca (Max)*).
* ``"pow2"``   -- reserve the next power of two of the true final length (*Orca (Pow2)*).
* ``"oracle"`` -- reserve exactly ``prompt_len + output_len`` (*Orca (Oracle)*: a server
  that magically knows the output length).
* ``"paged"``  -- blocks of ``block_size`` slots, allocated one at a time as tokens
  arrive, anywhere in the pool (vLLM). When a running request needs a block and
  none is free, the most recently admitted request is **preempted**: its blocks
  are freed and it goes back to the head of the queue, to be recomputed later.

The reservation strategies place each reservation in one contiguous range of the
pool (first fit), because pre-paging kernels want one tensor per request; pass
``contiguous=False`` to remove that constraint and see how much of their waste is
external fragmentation.

Memory accounting, per step, for a running request holding ``A`` allocated slots,
``L`` live tokens and final length ``T``:

* live      = ``L``                       -- slots holding a token's K/V now
* reserved  = ``min(A, T) - L``           -- slots that a later token of this request will fill
* internal  = ``max(A - T, 0)``           -- slots this request holds but will never fill
* external  = free slots while a request waits -- free, yet the waiting request at the
  head of the queue cannot use them (no gap large enough, not enough blocks, or the
  few slots left over when ``pool_tokens`` is not a multiple of ``block_size``)

Averaged over the **saturated** steps (a request is waiting after admission, so memory
is the bottleneck) these four add up to the whole pool. This is the breakdown of
Figure 2 in Kwon et al., *Efficient Memory Management for Large Language Model
Serving with PagedAttention* (SOSP 2023).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Request",
    "SimResult",
    "STRATEGIES",
    "make_trace",
    "reserved_slots",
    "simulate",
    "block_size_sweep",
]

STRATEGIES = ("max", "pow2", "oracle", "paged")


@dataclass(frozen=True)
class Request:
    """One request of a trace. ``arrival`` is the step at which it reaches the server."""

    req_id: int
    arrival: int
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        """Tokens the request holds when it finishes: prompt plus every generated token."""
        return self.prompt_len + self.output_len


def _positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def make_trace(
    num_requests: int,
    seed: int = 0,
    *,
    arrival_rate: float = 1.0,
    prompt_median: float = 100.0,
    prompt_sigma: float = 1.0,
    output_median: float = 200.0,
    output_sigma: float = 1.0,
    max_len: int = 2048,
) -> list[Request]:
    """A seeded synthetic trace with long-tailed lengths and Poisson arrivals.

    Prompt and output lengths are log-normal (median ``*_median``, log-space standard
    deviation ``*_sigma``), rounded, at least 1, and clipped so that
    ``prompt_len + output_len <= max_len``. With the defaults the means are about
    165 prompt and 330 output tokens -- close to the ShareGPT statistics the vLLM
    paper reports (161 input, 338 output tokens on average). Arrivals are a Poisson
    process with ``arrival_rate`` requests per step.
    """
    num_requests = _positive_int("num_requests", num_requests)
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    arrival_rate = _positive_float("arrival_rate", arrival_rate)
    for name, value in (
        ("prompt_median", prompt_median),
        ("output_median", output_median),
        ("prompt_sigma", prompt_sigma),
        ("output_sigma", output_sigma),
    ):
        _positive_float(name, value)
    max_len = _positive_int("max_len", max_len)
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2 (one prompt and one output token), got {max_len}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / arrival_rate, size=num_requests)
    arrivals = np.floor(np.cumsum(gaps)).astype(int)
    prompts = np.rint(rng.lognormal(math.log(prompt_median), prompt_sigma, size=num_requests)).astype(int)
    outputs = np.rint(rng.lognormal(math.log(output_median), output_sigma, size=num_requests)).astype(int)
    prompts = np.clip(prompts, 1, max_len - 1)
    outputs = np.clip(outputs, 1, max_len - prompts)
    return [Request(i, int(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


def reserved_slots(request: Request, strategy: str, max_len: int) -> int:
    """Slots a reservation strategy sets aside for ``request`` when it is admitted."""
    if strategy == "max":
        return max_len
    if strategy == "pow2":
        return min(1 << (request.total_len - 1).bit_length(), max_len)
    if strategy == "oracle":
        return request.total_len
    raise ValueError(f"strategy must be one of 'max', 'pow2', 'oracle' for a reservation, got {strategy!r}")


@dataclass
class SimResult:
    """What one simulated run measured.

    Fractions are of the whole pool, averaged over the saturated steps (over every step
    when no request ever had to wait); ``live_frac + reserved_frac + internal_frac +
    external_frac == 1``.
    """

    strategy: str
    block_size: int | None
    pool_tokens: int
    num_requests: int
    steps: int  # from step 0 to the last request's finish (the makespan)
    saturated_steps: int  # steps with a request still waiting after admission
    live_frac: float  # "utilization": fraction of the pool holding live tokens
    reserved_frac: float  # held for tokens the request will still produce
    internal_frac: float  # held but never to be filled
    external_frac: float  # free, but unusable by the waiting request
    live_over_allocated: float  # of the memory handed out to requests, the fraction holding tokens
    mean_running: float  # requests running at once (saturated steps)
    max_running: int
    peak_allocated: int  # most slots ever handed out at once (<= usable pool)
    preemptions: int  # paged only: requests evicted to free blocks
    recomputed_tokens: int  # paged only: tokens prefilled again after a preemption
    mean_block_table_len: float  # paged only: block-table entries per running request
    finish_step: dict[int, int] = field(repr=False)  # req_id -> step its last token was produced
    live_series: np.ndarray = field(repr=False)  # live slots at each step
    allocated_series: np.ndarray = field(repr=False)  # allocated slots at each step
    running_series: np.ndarray = field(repr=False)  # running requests at each step
    snapshot: list[dict] | None = field(default=None, repr=False)  # running requests at ``snapshot_step``

    @property
    def throughput(self) -> float:
        """Requests finished per 1000 steps over the whole run."""
        return 1000.0 * self.num_requests / self.steps

    def breakdown(self) -> dict[str, float]:
        """``live``, ``reserved``, ``internal``, ``external``: fractions of the pool; they sum to 1."""
        return {
            "live": self.live_frac,
            "reserved": self.reserved_frac,
            "internal": self.internal_frac,
            "external": self.external_frac,
        }


class _ContiguousPool:
    """First-fit allocator of contiguous slot ranges; tracks free gaps sorted by start."""

    def __init__(self, size: int, contiguous: bool) -> None:
        self.size, self.contiguous = size, contiguous
        self.free_starts, self.free_lens = [0], [size]
        self.free_total = size

    def alloc(self, n: int) -> int | None:
        if n > self.free_total:
            return None
        if not self.contiguous:
            self.free_total -= n
            return -1
        for i, length in enumerate(self.free_lens):
            if length >= n:
                start = self.free_starts[i]
                if length == n:
                    del self.free_starts[i], self.free_lens[i]
                else:
                    self.free_starts[i] += n
                    self.free_lens[i] -= n
                self.free_total -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        self.free_total += n
        if not self.contiguous:
            return
        i = bisect.bisect_left(self.free_starts, start)
        self.free_starts.insert(i, start)
        self.free_lens.insert(i, n)
        if i + 1 < len(self.free_starts) and start + n == self.free_starts[i + 1]:  # merge right
            self.free_lens[i] += self.free_lens[i + 1]
            del self.free_starts[i + 1], self.free_lens[i + 1]
        if i > 0 and self.free_starts[i - 1] + self.free_lens[i - 1] == start:  # merge left
            self.free_lens[i - 1] += self.free_lens[i]
            del self.free_starts[i], self.free_lens[i]


@dataclass
class _Running:
    req: Request
    admitted: int  # order of admission (for choosing whom to preempt)
    generated: int  # output tokens produced so far
    allocated: int  # slots held
    offset: int = -1  # start of the contiguous range (reservation strategies)


def simulate(
    trace: list[Request],
    pool_tokens: int,
    strategy: str,
    block_size: int | None = None,
    *,
    max_len: int = 2048,
    contiguous: bool = True,
    max_running: int | None = None,
    watermark: float = 0.01,
    snapshot_step: int | None = None,
) -> SimResult:
    """Serve ``trace`` from a pool of ``pool_tokens`` KV slots with one allocation ``strategy``.

    ``block_size`` is required for ``"paged"`` (the pool holds ``pool_tokens // block_size``
    blocks) and must be ``None`` otherwise. ``max_len`` is the context limit that
    ``"max"`` reserves and that caps ``"pow2"``. ``max_running`` caps the batch (``None``:
    memory is the only limit). ``watermark`` (paged only) is the fraction of blocks that
    admission leaves free for running requests to grow into (vLLM's default is 0.01); a
    larger one means fewer preemptions and fewer requests at once. ``snapshot_step``
    records the running requests at that step.
    """
    if not isinstance(trace, (list, tuple)) or not trace or not all(isinstance(r, Request) for r in trace):
        raise TypeError("trace must be a non-empty list of Request (see make_trace)")
    pool_tokens = _positive_int("pool_tokens", pool_tokens)
    max_len = _positive_int("max_len", max_len)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "paged":
        if block_size is None:
            raise ValueError("block_size is required for strategy='paged'")
        block_size = _positive_int("block_size", block_size)
        if block_size > pool_tokens:
            raise ValueError(f"block_size ({block_size}) must not exceed pool_tokens ({pool_tokens})")
    elif block_size is not None:
        raise ValueError(f"block_size is only used by strategy='paged', got block_size={block_size!r}")
    if max_running is not None:
        max_running = _positive_int("max_running", max_running)
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a number in [0, 1), got {watermark!r}")
    too_long = [r.req_id for r in trace if r.total_len > max_len]
    if too_long:
        raise ValueError(f"requests {too_long[:5]} are longer than max_len={max_len}")
    if strategy == "paged":
        need_max = max(math.ceil(r.total_len / block_size) * block_size for r in trace)
    else:
        need_max = max(reserved_slots(r, strategy, max_len) for r in trace)
    usable = pool_tokens if strategy != "paged" else (pool_tokens // block_size) * block_size
    if need_max > usable:
        raise ValueError(f"pool_tokens={pool_tokens} cannot hold even one request of {need_max} slots")

    pending = deque(sorted(trace, key=lambda r: (r.arrival, r.req_id)))
    waiting: deque[_Running | Request] = deque()  # Requests, or preempted _Running to resume
    running: list[_Running] = []
    pool = _ContiguousPool(pool_tokens, contiguous) if strategy != "paged" else None
    b = block_size or 1
    free_blocks = pool_tokens // b if strategy == "paged" else 0
    keep_free = int(watermark * free_blocks)

    def final_hold(r: _Running) -> int:  # min(A, T): slots of this allocation that will hold tokens
        return min(r.allocated, r.req.total_len)

    # running totals, updated incrementally
    live = allocated = useful = 0  # useful = sum of min(A, T)
    finish_step: dict[int, int] = {}
    live_s, alloc_s, run_s = [], [], []
    keys = ("n", "live", "reserved", "internal", "external", "running", "alloc", "blocks")
    sat = dict.fromkeys(keys, 0)  # totals over saturated steps
    every = dict.fromkeys(keys, 0)  # totals over all steps (used when no step was saturated)
    preemptions = recomputed = 0
    admit_counter = 0
    snapshot = None
    step = 0

    def release(r: _Running) -> None:
        nonlocal live, allocated, useful, free_blocks
        live -= r.req.prompt_len + r.generated
        allocated -= r.allocated
        useful -= final_hold(r)
        if pool is not None:
            pool.free(r.offset, r.allocated)
        else:
            free_blocks += r.allocated // b

    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        # 1. every running request produces one more token (paged: may need a new block)
        if strategy == "paged":
            running.sort(key=lambda r: r.admitted)
            i = 0
            while i < len(running):
                r = running[i]
                if r.req.prompt_len + r.generated == r.allocated:  # last block full: need another
                    while free_blocks == 0 and running[-1] is not r:
                        victim = running.pop()  # latest admitted
                        release(victim)
                        recomputed += victim.req.prompt_len + victim.generated
                        victim.allocated = 0
                        waiting.appendleft(victim)
                        preemptions += 1
                    if free_blocks == 0:  # r itself is the latest: preempt it
                        running.pop()
                        release(r)
                        recomputed += r.req.prompt_len + r.generated
                        r.allocated = 0
                        waiting.appendleft(r)
                        preemptions += 1
                        continue
                    free_blocks -= 1
                    useful -= final_hold(r)
                    r.allocated += b
                    allocated += b
                    useful += final_hold(r)
                r.generated += 1
                live += 1
                i += 1
        else:
            for r in running:
                r.generated += 1
            live += len(running)
        # 2. admit waiting requests, first come first served (no overtaking)
        while waiting and (max_running is None or len(running) < max_running):
            head = waiting[0]
            if isinstance(head, _Running):  # a preempted request resumes: re-prefill what it had
                req, generated = head.req, head.generated
            else:
                req, generated = head, 0
            tokens = req.prompt_len + generated + 1  # prefill, plus the slot of the token it produces
            if strategy == "paged":
                need = math.ceil(tokens / b)
                if need > free_blocks - (keep_free if running else 0):
                    break
                free_blocks -= need
                slots, offset = need * b, -1
            else:
                slots = reserved_slots(req, strategy, max_len)
                offset = pool.alloc(slots)
                if offset is None:
                    break
            waiting.popleft()
            r = _Running(req, admit_counter, generated + 1, slots, offset)
            admit_counter += 1
            running.append(r)
            live += tokens
            allocated += slots
            useful += final_hold(r)
        # 3. measure
        live_s.append(live)
        alloc_s.append(allocated)
        run_s.append(len(running))
        for totals in (every, sat) if waiting else (every,):
            totals["n"] += 1
            totals["live"] += live
            totals["reserved"] += useful - live
            totals["internal"] += allocated - useful
            totals["external"] += pool_tokens - allocated
            totals["running"] += len(running)
            totals["alloc"] += allocated
            totals["blocks"] += allocated // b
        if snapshot_step is not None and step == snapshot_step:
            snapshot = [
                {
                    "req_id": r.req.req_id,
                    "prompt_len": r.req.prompt_len,
                    "live": r.req.prompt_len + r.generated,
                    "allocated": r.allocated,
                    "total_len": r.req.total_len,
                    "offset": r.offset,
                }
                for r in sorted(running, key=lambda r: (r.offset, r.admitted))
            ]
        # 4. finished requests free their memory
        still = []
        for r in running:
            if r.generated >= r.req.output_len:
                finish_step[r.req.req_id] = step
                release(r)
            else:
                still.append(r)
        running = still
        step += 1
        if step > 10_000_000:  # a bug, not a workload
            raise RuntimeError("simulation did not terminate")

    saturated_steps = sat["n"]
    if saturated_steps == 0:  # memory never held anyone back: average over the whole run
        sat = every
    n = sat["n"]
    live_series = np.asarray(live_s, dtype=np.int64)
    alloc_series = np.asarray(alloc_s, dtype=np.int64)
    run_series = np.asarray(run_s, dtype=np.int64)
    return SimResult(
        strategy=strategy,
        block_size=block_size,
        pool_tokens=pool_tokens,
        num_requests=len(trace),
        steps=step,
        saturated_steps=saturated_steps,
        live_frac=sat["live"] / (n * pool_tokens),
        reserved_frac=sat["reserved"] / (n * pool_tokens),
        internal_frac=sat["internal"] / (n * pool_tokens),
        external_frac=sat["external"] / (n * pool_tokens),
        live_over_allocated=sat["live"] / sat["alloc"] if sat["alloc"] else float("nan"),
        mean_running=sat["running"] / n,
        max_running=int(run_series.max()),
        peak_allocated=int(alloc_series.max()),
        preemptions=preemptions,
        recomputed_tokens=recomputed,
        mean_block_table_len=sat["blocks"] / sat["running"] if strategy == "paged" and sat["running"] else float("nan"),
        finish_step=finish_step,
        live_series=live_series,
        allocated_series=alloc_series,
        running_series=run_series,
        snapshot=snapshot,
    )


def block_size_sweep(
    trace: list[Request],
    pool_tokens: int,
    block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    **kwargs,
) -> list[SimResult]:
    """:func:`simulate` with ``strategy="paged"`` once per block size."""
    block_sizes = list(block_sizes)
    if not block_sizes:
        raise ValueError("block_sizes must not be empty")
    return [simulate(trace, pool_tokens, "paged", block_size=b, **kwargs) for b in block_sizes]
