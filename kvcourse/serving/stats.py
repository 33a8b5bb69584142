"""What an engine run measured: the event log of its steps, counters, and latency percentiles.

Each step leaves one :class:`StepEvent`: which requests ran how many tokens (and of what kind:
prefill, chunk, decode, recompute), who was admitted, preempted and finished, and the pool's free
blocks. Chapter 6 draws it as a timeline (:func:`kvcourse.serving.plots.plot_timeline`).
The engine's :class:`~kvcourse.serving.engine.StepRecorder` writes them as the steps run; this module reports:
:func:`latency_summary` and :func:`engine_stats` (``Engine.stats``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ..sequence import Request, RequestMetrics

__all__ = ["StepEvent", "engine_stats", "latency_summary", "percentile"]


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


def engine_stats(counters: Mapping[str, int], requests: Mapping[Hashable, Request], runner) -> dict:
    """An engine's ``counters`` (its :class:`~kvcourse.serving.engine.StepRecorder`'s), what the pool and the
    ``runner`` counted, latency percentiles of the finished ``requests`` and every request's metrics (see
    ``Engine.stats``)."""
    stats = dict(counters)
    queried = stats["prefix_cache_queried_tokens"]
    stats["prefix_cache_hit_rate"] = stats["prefix_cache_hit_tokens"] / queried if queried else math.nan
    bm = runner.block_manager
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
