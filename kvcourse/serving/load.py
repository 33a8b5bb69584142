"""Open-loop load: requests arrive at their own times, and the engine serves them as they come.

Chapter 6's first sweep sends every request at t=0 and varies ``max_num_seqs``: it measures capacity,
not what a user sees. A real server is *open loop*: requests keep arriving whether or not the last
ones are done. Here they arrive as a Poisson process of rate ``rate`` (requests/s; the gaps between
arrivals are exponential), and one sweep over rates shows where the server stops keeping up.

Each step is charged to a :class:`ModelledClock` by a :class:`StepCost` fitted to steps the real engine
ran on a measured CPU (:func:`fit_step_cost`), so the sweep is quick, repeatable and the same on every
machine, while the engine still schedules, allocates and computes every token. ``make bench-engine``'s
``bench_load.py`` checks the model against the wall clock. The definitions:

* **SLO attainment**: the fraction of requests whose TTFT *and* TPOT meet their targets.
* **Goodput** (DistServe, Zhong et al. 2024): the highest request rate served with at least
  ``target`` (90%) SLO attainment; a server that is fast on average but misses the tail has little.
* **Little's law**: the mean number of requests in the system, ``L``, equals the arrival rate times
  the mean time each spends there, ``L = lambda * W``, for any stable queue.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..checks import check_float, check_int
from .stats import StepEvent, latency_summary

__all__ = [
    "LoadPoint",
    "ModelledClock",
    "StepCost",
    "fit_step_cost",
    "goodput",
    "mean_in_system",
    "poisson_arrivals",
    "serve_open_loop",
    "slo_attainment",
]


def poisson_arrivals(rate: float, num_requests: int, seed: int) -> np.ndarray:
    """Arrival times (seconds from 0) of ``num_requests`` requests arriving as a Poisson process of
    ``rate`` requests/s: independent exponential gaps of mean ``1 / rate``, seeded by ``seed``."""
    rate = check_float("rate", rate, min=0, min_open=True)
    num_requests = check_int("num_requests", num_requests, min=1)
    gaps = np.random.default_rng(check_int("seed", seed, min=0)).exponential(1.0 / rate, num_requests)
    return np.cumsum(gaps)


@dataclass(frozen=True)
class StepCost:
    """The time of one engine step: ``fixed_s`` (reading the weights once, whatever the batch), plus
    ``per_token_s`` for each token the step computes and ``per_seq_s`` for each sequence in it."""

    fixed_s: float
    per_token_s: float
    per_seq_s: float = 0.0

    def __post_init__(self) -> None:
        # A NaN cost would stall the modelled clock forever; a negative one would run it backwards.
        for name in ("fixed_s", "per_token_s", "per_seq_s"):
            object.__setattr__(self, name, check_float(f"StepCost.{name}", getattr(self, name), min=0))

    def seconds(self, num_tokens: int, num_seqs: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens + self.per_seq_s * num_seqs


def fit_step_cost(events: Iterable[StepEvent]) -> tuple[StepCost, float]:
    """Least squares of measured step durations on (1, tokens, sequences); returns the cost and R^2.

    The three coefficients are kept non-negative (a term that would come out negative is dropped and
    the rest refitted): a step never gets cheaper for carrying more work.
    """
    rows = [
        (1.0, e.num_tokens, len(e.scheduled), check_float(f"events[{i}].duration", e.duration, min=0))
        for i, e in enumerate(events)
    ]
    if len(rows) < 3:
        raise ValueError(f"events must hold at least 3 steps to fit 3 coefficients, got {len(rows)}")
    if not any(r[3] > 0 for r in rows):
        raise ValueError("events must include a step that took time: every duration is 0, there is nothing to fit")
    data = np.array(rows)
    x, y = data[:, :3], data[:, 3]
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[keep] = np.maximum(coef, 0.0)
    residual = y - x @ full
    r2 = 1.0 - float(residual @ residual) / float(((y - y.mean()) ** 2).sum() or math.inf)
    return StepCost(*map(float, full)), r2


class ModelledClock:
    """A clock that only moves when told to: the engine reads it as it reads ``time.perf_counter``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += check_float("seconds", seconds, min=0)

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, check_float("t", t))


class _ChargedRunner:
    """The engine's model runner, charging each forward's modelled cost to the clock. Everything else
    (the pools, the counters ``Engine.stats`` reads) is the real runner's."""

    def __init__(self, runner, clock: ModelledClock, cost: StepCost) -> None:
        self._runner, self._clock, self._cost = runner, clock, cost

    def launch(self, step):
        logits = self._runner.launch(step)
        self._clock.advance(self._cost.seconds(step.out.num_batched_tokens, len(step.out.scheduled)))
        return logits

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


def serve_open_loop(make_engine: Callable, prompts: Sequence[Sequence[int]], sampling_params,
                    arrivals: Sequence[float], cost: StepCost | None = None):  # fmt: skip
    """Serve ``prompts``, prompt ``i`` arriving at ``arrivals[i]`` seconds; return the engine.

    ``make_engine(clock)`` builds a fresh :class:`~kvcourse.serving.Engine` reading ``clock``. With a
    ``cost``, the clock is a :class:`ModelledClock` charged ``cost`` per step (and jumping over idle
    gaps); without one it is the wall clock, and idle gaps are slept through. Request ``i`` has id ``i``
    and its metrics carry its true arrival time, even when it arrived while a step was running.
    """
    if cost is not None and not isinstance(cost, StepCost):
        raise TypeError(f"cost must be a StepCost or None, got {type(cost).__name__}")
    arrivals = [check_float(f"arrivals[{i}]", t, min=0) for i, t in enumerate(arrivals)]
    if len(arrivals) != len(prompts) or any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError(f"arrivals must be {len(prompts)} non-decreasing times, one per prompt, got {len(arrivals)}")
    if cost is None:
        import time

        wall0 = time.perf_counter()
        clock = lambda: time.perf_counter() - wall0  # noqa: E731
        wait = lambda t: time.sleep(max(0.0, t - clock()))  # noqa: E731
    else:
        clock = ModelledClock()
        wait = clock.advance_to
    engine = make_engine(clock)
    if cost is not None:
        engine.runner = _ChargedRunner(engine.runner, clock, cost)
    start = engine.recorder.t0  # the engine's times count from its own start
    nxt = 0
    while nxt < len(prompts) or engine.has_unfinished_requests():
        while nxt < len(prompts) and arrivals[nxt] <= clock():
            engine.add_request(prompts[nxt], sampling_params, request_id=nxt)
            engine.requests[nxt].metrics.arrival_time = arrivals[nxt] - start  # it came mid-step, not now
            nxt += 1
        if engine.has_unfinished_requests():
            engine.step()
        else:
            wait(arrivals[nxt])
    return engine


def slo_attainment(metrics: Iterable, ttft_slo: float, tpot_slo: float) -> float:
    """The fraction of finished requests with TTFT <= ``ttft_slo`` and TPOT <= ``tpot_slo`` (seconds);
    a one-token answer has no TPOT and is judged on its TTFT."""
    ttft_slo = check_float("ttft_slo", ttft_slo, min=0, min_open=True)
    tpot_slo = check_float("tpot_slo", tpot_slo, min=0, min_open=True)
    done = [m for m in metrics if m.finish_time is not None]
    if not done:
        raise ValueError("metrics must hold at least one finished request")
    ok = [m.ttft <= ttft_slo and (math.isnan(m.tpot) or m.tpot <= tpot_slo) for m in done]
    return sum(ok) / len(ok)


def mean_in_system(events: Sequence[StepEvent], span: float) -> float:
    """``L``, the time-average number of requests in the system over ``span`` seconds, from the engine's
    own step log: during a step, the requests waiting or running after it plus those it finished (one
    sample per request). Idle gaps count zero. A request that arrives during a step is counted from the
    next one, so this falls short of the requests' own timestamps by about half a step per request."""
    span = check_float("span", span, min=0, min_open=True)
    if not events:
        raise ValueError("events must hold at least one step")
    return sum((e.num_waiting + e.num_running + len(e.finished)) * e.duration for e in events) / span


@dataclass(frozen=True)
class LoadPoint:
    """One rate of a sweep: the offered ``rate`` (requests/s), the latency summary
    (:func:`~kvcourse.serving.latency_summary`), SLO attainment, and Little's law's two sides."""

    rate: float
    summary: dict
    attainment: float
    achieved_rate: float  # finished requests / (last finish - first arrival)
    mean_in_system: float  # L, from the step log
    mean_latency: float  # W, from the requests' own timestamps

    @property
    def littles_law_ratio(self) -> float:
        """``L / (lambda * W)`` with the achieved rate: 1 when the books balance."""
        return self.mean_in_system / (self.achieved_rate * self.mean_latency)

    @classmethod
    def of(cls, rate: float, engine, ttft_slo: float, tpot_slo: float) -> LoadPoint:
        metrics = [m for m in engine.stats["requests"].values() if m.finish_time is not None]
        if not metrics:
            raise ValueError("engine has no finished request: serve the load to the end before summarising it")
        ttft_slo = check_float("ttft_slo", ttft_slo, min=0, min_open=True)
        tpot_slo = check_float("tpot_slo", tpot_slo, min=0, min_open=True)
        summary = latency_summary(metrics)
        span = max(m.finish_time for m in metrics) - min(m.arrival_time for m in metrics)
        if span <= 0:
            raise ValueError("the requests finished the moment they arrived (a StepCost of 0?): no rate to measure")
        return cls(rate=rate, summary=summary, attainment=slo_attainment(metrics, ttft_slo, tpot_slo),
                   achieved_rate=len(metrics) / span, mean_in_system=mean_in_system(engine.events, span),
                   mean_latency=float(np.mean([m.e2e_latency for m in metrics])))  # fmt: skip


def goodput(points: Iterable[LoadPoint], target: float = 0.9) -> float:
    """The highest offered rate whose SLO attainment is at least ``target``; 0.0 if none is."""
    target = check_float("target", target, min=0, max=1, min_open=True)
    return max((p.rate for p in points if p.attainment >= target), default=0.0)
