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

Admission, growth and preemption are not written here: the simulator is chapter 6's
:class:`kvcourse.serving.Scheduler` (the serving engine's) driven by the trace instead
of a model, with one pool per strategy behind the same :class:`~kvcourse.paged.KVPool` calls: the
paged pool a real :class:`~kvcourse.paged.BlockManager` (:class:`PagedPool`), the reservations a
:class:`ReservationPool`. One policy for both. Both pools count a token's slot from the step that
makes it, so they admit a prompt with one slot more than the engine does.

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
from dataclasses import dataclass, field, fields

import numpy as np

from .checks import check_choice, check_float, check_int
from .paged import Admission, BlockManager
from .paged.block_manager import num_tokens_to_admit
from .sequence import SamplingParams, Sequence
from .serving.scheduler import Scheduler

__all__ = [
    "MemoryTotals",
    "PagedPool",
    "Request",
    "ReservationPool",
    "SimResult",
    "STRATEGIES",
    "make_trace",
    "reserved_slots",
    "simulate",
    "block_size_sweep",
    "reservation_live_fraction",
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
    return check_int(name, value, min=1)


def _positive_float(name: str, value) -> float:
    return check_float(name, value, min=0, min_open=True)


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
    check_int("seed", seed)
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

    @classmethod
    def from_totals(cls, strategy: str, block_size: int | None, pool_tokens: int, num_requests: int,
                    saturated: MemoryTotals, every: MemoryTotals, series: list[MemoryTotals], preemptions: int,
                    recomputed_tokens: int, finish_step: dict[int, int],
                    snapshot: list[dict] | None) -> SimResult:  # fmt: skip
        """A run's result from its totals over the saturated steps (over every step if none was) and its
        per-step series."""
        t = saturated if saturated.steps else every  # memory never held anyone back: the whole run
        whole = t.steps * pool_tokens
        column = lambda name: np.asarray([getattr(m, name) for m in series], dtype=np.int64)  # noqa: E731
        return cls(
            strategy=strategy, block_size=block_size, pool_tokens=pool_tokens, num_requests=num_requests,
            steps=len(series), saturated_steps=saturated.steps,
            live_frac=t.live / whole, reserved_frac=(t.useful - t.live) / whole,
            internal_frac=(t.allocated - t.useful) / whole, external_frac=(whole - t.allocated) / whole,
            live_over_allocated=t.live / t.allocated if t.allocated else float("nan"),
            mean_running=t.running / t.steps, max_running=int(column("running").max()),
            peak_allocated=int(column("allocated").max()), preemptions=preemptions,
            recomputed_tokens=recomputed_tokens,
            mean_block_table_len=(t.allocated // block_size / t.running if block_size and t.running
                                  else float("nan")),
            finish_step=finish_step, live_series=column("live"), allocated_series=column("allocated"),
            running_series=column("running"), snapshot=snapshot,
        )  # fmt: skip

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


class ReservationPool:
    """The reservation strategies as a :class:`~kvcourse.paged.KVPool`, so one scheduler serves all four.

    A pool of ``pool_tokens`` slots in blocks of one slot. Admitting a sequence reserves its whole
    reservation (``reservations[seq_id]`` slots: max, pow2 or oracle) at once, in one contiguous range
    (first fit) unless ``contiguous=False``; it never needs another slot afterwards. Its whole prompt
    is admitted, with one slot more for the token the step makes (the simulator counts a token's slot
    from the step that makes it).
    """

    block_size = 1
    enable_prefix_caching = False
    num_host_blocks = 0  # no host pool: nothing is swapped

    def __init__(self, pool_tokens: int, contiguous: bool, reservations: dict) -> None:
        self.num_blocks = pool_tokens
        self._pool = _ContiguousPool(pool_tokens, contiguous)
        self._reservations = reservations
        self._held: dict = {}  # seq_id -> [offset, reserved slots, tokens held]

    @property
    def num_free_blocks(self) -> int:
        return self._pool.free_total

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._held

    def blocks_needed(self, num_tokens: int) -> int:
        return num_tokens

    def num_tokens(self, seq_id) -> int:
        return self._held[seq_id][2]

    def offset(self, seq_id) -> int:
        """Start of ``seq_id``'s range (``-1`` when ranges need not be contiguous)."""
        return self._held[seq_id][0]

    def allocated_slots(self, seq_id) -> int:
        """Slots handed to ``seq_id``: its reservation."""
        return self._held[seq_id][1]

    def admit(
        self, seq, max_num_new_tokens: int, *, chunked: bool = True, keep_free: int = 0, cache_salt: str | None = None
    ) -> Admission | None:
        """Reserve ``seq``'s range if one is free (first fit); ``None`` if not. ``keep_free`` and ``chunked``
        are unused: a reservation never grows, and the prompt is admitted whole."""
        n = num_tokens_to_admit(seq.num_tokens, max_num_new_tokens, chunked=False)
        size = self._reservations[seq.seq_id]
        if n is None or n + 1 > size:
            raise ValueError(f"{seq.num_tokens} tokens and the next exceed the reservation of {size} slots")
        offset = self._pool.alloc(size)
        if offset is None:
            return None
        self._held[seq.seq_id] = [offset, size, n + 1]
        return Admission(0, n)

    def append_slots(self, seq_id, num_tokens: int) -> None:
        offset, size, held = self._held[seq_id]
        if held + num_tokens > size:
            raise RuntimeError(f"{seq_id!r} outgrew its reservation of {size} slots")
        self._held[seq_id][2] += num_tokens  # reserved up front: never short of a block

    def free(self, seq_id) -> None:
        offset, size, _ = self._held.pop(seq_id)
        self._pool.free(offset, size)


class PagedPool(BlockManager):
    """The paged strategy: a :class:`~kvcourse.paged.BlockManager` whose admission holds one slot more
    than the prompt, for the token the step makes (the simulator counts a token's slot from the step
    that makes it). Prompts are admitted whole."""

    def admit(
        self, seq, max_num_new_tokens: int, *, chunked: bool = True, keep_free: int = 0, cache_salt: str | None = None
    ) -> Admission | None:
        n = num_tokens_to_admit(seq.num_tokens, max_num_new_tokens, chunked=False)
        if n is None or self.blocks_needed(n + 1) > self.num_free_blocks - keep_free:
            return None
        self.allocate(seq.seq_id, n + 1)
        return Admission(0, n)

    def allocated_slots(self, seq_id) -> int:
        """Slots handed to ``seq_id``: its blocks."""
        return len(self.block_table(seq_id)) * self.block_size

    def offset(self, seq_id) -> int:
        """``-1``: blocks have no one start."""
        return -1


@dataclass
class MemoryTotals:
    """Slots summed over steps, and the steps summed: one step's measurement, or a run's totals."""

    steps: int = 0
    live: int = 0  # slots holding a token's K/V
    useful: int = 0  # allocated slots that their request fills, now or later (live + reserved)
    allocated: int = 0  # slots handed out (useful + internal)
    running: int = 0  # requests running

    def add(self, other: MemoryTotals) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _measure(pool: ReservationPool | PagedPool, running: list[Sequence], final_len: dict[int, int]) -> MemoryTotals:
    """One step's memory. With its lookahead slot, a request holds exactly its tokens (prompt + produced)."""
    live = sum(pool.num_tokens(seq.seq_id) for seq in running)
    useful = sum(min(pool.allocated_slots(seq.seq_id), final_len[seq.seq_id]) for seq in running)
    allocated = (pool.num_blocks - pool.num_free_blocks) * pool.block_size
    return MemoryTotals(1, live, useful, allocated, len(running))


def _snapshot(pool: ReservationPool | PagedPool, running: list[Sequence], final_len: dict[int, int]) -> list[dict]:
    """The running requests, in pool order (stable: admission order for blocks)."""
    return [
        {"req_id": seq.seq_id, "prompt_len": seq.num_prompt_tokens, "live": pool.num_tokens(seq.seq_id),
         "allocated": pool.allocated_slots(seq.seq_id), "total_len": final_len[seq.seq_id],
         "offset": pool.offset(seq.seq_id)}
        for seq in sorted(running, key=lambda s: pool.offset(s.seq_id))
    ]  # fmt: skip


def _make_pool(trace, pool_tokens, strategy, block_size, max_len, contiguous) -> ReservationPool | PagedPool:
    """The strategy's pool, after checking that the longest request fits it alone."""
    if strategy == "paged":
        need = max(math.ceil(r.total_len / block_size) * block_size for r in trace)
        usable = (pool_tokens // block_size) * block_size
    else:
        need, usable = max(reserved_slots(r, strategy, max_len) for r in trace), pool_tokens
    if need > usable:
        raise ValueError(f"pool_tokens={pool_tokens} cannot hold even one request of {need} slots")
    if strategy == "paged":
        return PagedPool(pool_tokens // block_size, block_size)
    return ReservationPool(pool_tokens, contiguous, {r.req_id: reserved_slots(r, strategy, max_len) for r in trace})


def _check_simulate_args(trace, pool_tokens, strategy, block_size, max_len, max_running, watermark):
    if not isinstance(trace, (list, tuple)) or not trace or not all(isinstance(r, Request) for r in trace):
        raise TypeError("trace must be a non-empty list of Request (see make_trace)")
    pool_tokens = _positive_int("pool_tokens", pool_tokens)
    max_len = _positive_int("max_len", max_len)
    check_choice("strategy", strategy, STRATEGIES)
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
    check_float("watermark", watermark, min=0, max=1, max_open=True)
    too_long = [r.req_id for r in trace if r.total_len > max_len]
    if too_long:
        raise ValueError(f"requests {too_long[:5]} are longer than max_len={max_len}")
    return pool_tokens, block_size, max_len, max_running


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

    The policy is chapter 6's :class:`~kvcourse.serving.Scheduler` (no token budget, no chunking),
    driven by the trace instead of a model: each request is a :class:`~kvcourse.Sequence` of
    ``prompt_len`` placeholder tokens that stops after ``output_len`` tokens, and its memory is a
    :class:`PagedPool` (paged) or a :class:`ReservationPool`. A token's slot counts from the step
    that produces it: both pools admit a prompt with one slot more.
    """
    pool_tokens, block_size, max_len, max_running = _check_simulate_args(
        trace, pool_tokens, strategy, block_size, max_len, max_running, watermark
    )
    pool = _make_pool(trace, pool_tokens, strategy, block_size, max_len, contiguous)
    # A reservation never grows: nothing to keep free for growth.
    scheduler = Scheduler(pool, max_num_seqs=max_running, watermark=watermark if strategy == "paged" else 0.0)
    final_len = {r.req_id: r.total_len for r in trace}
    pending = deque(sorted(trace, key=lambda r: (r.arrival, r.req_id)))
    saturated, every, series = MemoryTotals(), MemoryTotals(), []
    finish_step: dict[int, int] = {}
    preemptions = recomputed = step = 0
    snapshot = None
    while pending or scheduler.has_unfinished():
        while pending and pending[0].arrival <= step:
            r = pending.popleft()
            params = SamplingParams(max_new_tokens=r.output_len, stop_token_ids=())
            scheduler.add(Sequence(r.req_id, [0] * r.prompt_len, params))
        out = scheduler.schedule()  # every running request grows by one token; then admission
        preemptions += len(out.preempted)
        recomputed += sum(seq.num_tokens for seq in out.preempted)  # prefilled again when re-admitted
        memory = _measure(pool, scheduler.running, final_len)
        series.append(memory)
        for totals in (every, saturated) if scheduler.waiting else (every,):
            totals.add(memory)
        if step == snapshot_step:
            snapshot = _snapshot(pool, scheduler.running, final_len)
        # The step runs: each scheduled request produces a (placeholder) token; finished ones free memory.
        for seq in scheduler.advance_without_model(out):
            finish_step[seq.seq_id] = step
        step += 1
        if step > 10_000_000:  # a bug, not a workload
            raise RuntimeError("simulation did not terminate")
    return SimResult.from_totals(strategy, block_size, pool_tokens, len(trace), saturated, every, series,
                                 preemptions, recomputed, finish_step, snapshot)  # fmt: skip


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


def reservation_live_fraction(prompt_lens, output_lens, max_len: int) -> float:
    """The share of max-length reservations that holds tokens, averaged over time: chapter 4's model of ``"max"``.

    A request with ``o`` output tokens runs for ``o`` steps and at its ``k``-th (``k = 1 .. o``) holds its prompt
    and the ``k`` tokens made so far (a slot counts from the step that makes its token, as in :func:`simulate`), so
    ``p + (o + 1) / 2`` on average. Weighting each request by the steps it runs, not counting it once, is what makes
    this right: a snapshot of a busy server meets a long request more often than a short one.
    """
    check_int("max_len", max_len, min=1)
    p = np.asarray(prompt_lens, dtype=np.float64)
    o = np.asarray(output_lens, dtype=np.float64)
    if p.ndim != 1 or o.shape != p.shape or not len(p):
        raise ValueError(
            f"prompt_lens and output_lens must be two 1-D sequences of one length >= 1, got shapes "
            f"{p.shape} and {o.shape}"
        )
    if (p < 1).any() or (o < 1).any() or (p + o > max_len).any():
        raise ValueError(f"every request needs prompt_lens >= 1, output_lens >= 1 and a total <= max_len={max_len}")
    return float((o * (p + (o + 1) / 2)).sum() / o.sum() / max_len)
