"""What an engine run measured: the event log of its steps, counters, and latency percentiles.

Each step leaves one :class:`StepEvent`: which requests ran how many tokens (and of what kind:
prefill, chunk, decode, recompute), who was admitted, preempted and finished, and the pool's free
blocks. Chapter 6 draws it as a timeline (:func:`kvcourse.serving.plots.plot_timeline`).
A :class:`StepRecorder` writes all of it, so the engine's loop only runs steps.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .request import Request, RequestMetrics

if TYPE_CHECKING:
    from .scheduler import Scheduler, SchedulerOutput

__all__ = ["StepEvent", "StepRecorder", "latency_summary", "percentile"]


@dataclass(frozen=True)
class StepEvent:
    """One engine step. Request entries are ``(request_id, sample_index)``; ``scheduled`` entries are
    ``(request_id, sample_index, num_tokens, kind)``. Times are seconds since the engine started."""

    step: int
    start: float
    duration: float
    scheduled: tuple[tuple[Hashable, int, int, str], ...]
    admitted: tuple[tuple[Hashable, int], ...]
    preempted: tuple[tuple[Hashable, int], ...]
    finished: tuple[tuple[Hashable, int], ...]
    num_free_blocks: int
    num_waiting: int
    num_running: int
    num_copies: int  # copy-on-write block copies done before the forward

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n, _ in self.scheduled)


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation) of the values that are not NaN; NaN if none."""
    xs = [v for v in values if not math.isnan(v)]
    return float(np.percentile(xs, q)) if xs else math.nan


def latency_summary(metrics: Iterable[RequestMetrics]) -> dict[str, float]:
    """p50/p99 of TTFT, TPOT, queue time and end-to-end latency (seconds), and output tokens/s.

    Throughput is the output tokens of the finished requests over the span from the first arrival
    to the last finish.
    """
    done = [m for m in metrics if m.finish_time is not None]
    out: dict[str, float] = {"requests": len(done)}
    for name in ("ttft", "tpot", "queue_time", "e2e_latency"):
        vals = [getattr(m, name) for m in done]
        out[f"{name}_p50"] = percentile(vals, 50)
        out[f"{name}_p99"] = percentile(vals, 99)
    span = max((m.finish_time for m in done), default=0.0) - min((m.arrival_time for m in done), default=0.0)
    tokens = sum(m.num_output_tokens for m in done)
    out["output_tokens"] = tokens
    out["duration"] = span
    out["output_tokens_per_s"] = tokens / span if span > 0 else math.nan
    return out


class StepRecorder:
    """Everything an engine counts, recorded in one place: the counters behind ``Engine.stats``, each
    request's :class:`RequestMetrics` (times in seconds since ``t0``, and step numbers), and one
    :class:`StepEvent` per step (``Engine.events``).

    Args:
        scheduler: the engine's scheduler (its queues and pool are read after each step).
        request_of: ``seq_id -> Request`` of the unfinished sequences, kept by the engine.
        t0: the clock's reading when the engine started.
    """

    COUNTERS = ("steps", "preemptions", "prompt_tokens", "recomputed_tokens", "generated_tokens",
                "batched_tokens", "finished", "cancelled", "copy_on_write_copies", "max_blocks_saved_by_sharing",
                "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "swapped_out", "swapped_in",
                "overlapped_steps", "overlap_rollbacks")  # fmt: skip

    def __init__(self, scheduler: Scheduler, request_of: Mapping[Hashable, Request], t0: float) -> None:
        self.scheduler, self.request_of, self.t0 = scheduler, request_of, t0
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.events: list[StepEvent] = []

    @property
    def num_steps(self) -> int:
        return self.counters["steps"]

    def new_metrics(self, num_prompt_tokens: int) -> RequestMetrics:
        """A request's metrics at its creation (its arrival time is stamped when it is queued)."""
        return RequestMetrics(math.nan, self.num_steps, num_prompt_tokens)

    def arrived(self, request: Request, now: float) -> None:
        request.metrics.arrival_time = now - self.t0

    def cancelled(self, request: Request, now: float) -> None:
        request.metrics.finish_time, request.metrics.finish_step = now - self.t0, self.num_steps
        self.counters["cancelled"] += 1

    def observe(self) -> dict:
        """The scheduler's queues and pool as a step leaves them (its tokens appended, before the next step is
        scheduled): what :meth:`record` logs. The overlapped engine reads them before it schedules ahead."""
        sched = self.scheduler
        bm = sched.block_manager  # blocks held by the running samples, less those they hold once
        held = sum(len(bm.block_table(seq.seq_id)) for seq in sched.running)
        return {"num_free_blocks": bm.num_free_blocks, "num_waiting": len(sched.waiting),
                "num_running": len(sched.running), "blocks_saved_by_sharing": held - bm.num_used_blocks}  # fmt: skip

    def record(
        self,
        out: SchedulerOutput,
        sampled: Mapping[Hashable, int],
        finished: list,
        start: float,
        end: float,
        observed: dict | None = None,
    ) -> None:
        """Count one step: what the scheduler did (``out``), the tokens ``sampled`` (``seq_id -> token``),
        the sequences that ``finished``; ``start`` and ``end`` on the engine's clock; ``observed``: the queues
        and pool after the step (:meth:`observe`; ``None``: as they are now)."""
        step = self.num_steps
        observed = dict(self.observe() if observed is None else observed)
        self._count(out, sampled, observed.pop("blocks_saved_by_sharing"))
        self._time_requests(out, sampled, finished, step, start, end)
        ids = lambda seqs: tuple(seq.seq_id for seq in seqs)  # noqa: E731  (request_id, sample index)
        self.events.append(StepEvent(
            step=step, start=start - self.t0, duration=end - start,
            scheduled=tuple((s.seq.seq_id[0], s.seq.seq_id[1], s.num_new_tokens, s.kind) for s in out.scheduled),
            admitted=ids(out.admitted), preempted=ids(out.preempted), finished=ids(finished),
            num_copies=len(out.copies), **observed,
        ))  # fmt: skip

    def stats(self, requests: Mapping[Hashable, Request], runner) -> dict:
        """The counters, what the pool and the ``runner`` counted, latency percentiles of the finished
        ``requests`` and every request's metrics (see ``Engine.stats``)."""
        stats = dict(self.counters)
        queried = stats["prefix_cache_queried_tokens"]
        stats["prefix_cache_hit_rate"] = stats["prefix_cache_hit_tokens"] / queried if queried else math.nan
        bm = self.scheduler.block_manager
        caching = bm.enable_prefix_caching
        stats["prefix_cache_evictions"] = bm.num_evictions if caching else 0
        stats["prefix_cache_offloaded_blocks"] = bm.num_offloaded_blocks if caching else 0
        stats["prefix_cache_host_hit_tokens"] = bm.num_host_hit_blocks * bm.block_size if caching else 0
        stats["blocks_to_host"] = runner.num_transferred_blocks["to_host"]
        stats["blocks_to_device"] = runner.num_transferred_blocks["to_device"]
        stats["transfer_seconds"] = runner.transfer_seconds
        stats["max_bytes_saved_by_sharing"] = stats["max_blocks_saved_by_sharing"] * runner.kv_store.block_nbytes
        stats.update(latency_summary(r.metrics for r in requests.values() if not r.cancelled))
        stats["requests"] = {rid: r.metrics for rid, r in requests.items()}
        return stats

    def _count(self, out: SchedulerOutput, sampled: Mapping[Hashable, int], saved: int) -> None:
        c = self.counters
        c["steps"] += 1
        c["preemptions"] += len(out.preempted)
        c["swapped_out"] += len(out.swapped_out)
        c["swapped_in"] += len(out.swapped_in)
        c["copy_on_write_copies"] += len(out.copies)
        c["prefix_cache_queried_tokens"] += out.num_prefix_cache_queried_tokens
        c["prefix_cache_hit_tokens"] += out.num_prefix_cache_hit_tokens
        c["generated_tokens"] += len(sampled)
        c["batched_tokens"] += out.num_batched_tokens
        c["recomputed_tokens"] += sum(s.num_recomputed_tokens for s in out.scheduled)
        c["max_blocks_saved_by_sharing"] = max(c["max_blocks_saved_by_sharing"], saved)

    def _time_requests(self, out, sampled, finished, step: int, start: float, end: float) -> None:
        for seq in out.admitted:
            m = self.request_of[seq.seq_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time, m.first_scheduled_step = start - self.t0, step
        for seq in out.preempted:
            self.request_of[seq.seq_id].metrics.num_preemptions += 1
        for seq_id in sampled:
            m = self.request_of[seq_id].metrics
            m.num_output_tokens += 1
            if m.first_token_time is None:
                m.first_token_time, m.first_token_step = end - self.t0, step
                self.counters["prompt_tokens"] += m.num_prompt_tokens
        for seq in finished:
            request = self.request_of[seq.seq_id]
            m = request.metrics
            m.max_sample_tokens = max(m.max_sample_tokens, len(seq.output_token_ids))
            if request.is_finished and m.finish_time is None:  # its last sample: once per request
                m.finish_time, m.finish_step = end - self.t0, step
                self.counters["finished"] += 1
