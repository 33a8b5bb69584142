"""Open-loop load (kvcourse.serving.load): Poisson arrivals, the modelled clock, SLOs, goodput, Little's law."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvcourse
from kvcourse import SamplingParams
from kvcourse.serving import Engine, RequestMetrics, StepEvent
from kvcourse.serving.load import (
    LoadPoint,
    ModelledClock,
    StepCost,
    fit_step_cost,
    goodput,
    mean_in_system,
    poisson_arrivals,
    serve_open_loop,
    slo_attainment,
)

from .conftest import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(7)


def _make(model, **kw):
    return lambda clock: Engine(
        model, num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, clock=clock, **kw
    )


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 101, int(k)).tolist() for k in rng.integers(3, 20, n)]


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_arrivals_are_seeded_increasing_with_mean_gap_one_over_rate(rate):
    a = poisson_arrivals(rate, 20_000, seed=3)
    assert np.array_equal(a, poisson_arrivals(rate, 20_000, seed=3))
    assert not np.array_equal(a, poisson_arrivals(rate, 20_000, seed=4))
    gaps = np.diff(np.concatenate([[0.0], a]))
    assert (gaps > 0).all()
    # the mean of 20,000 exponential gaps has a standard error of (1/rate)/sqrt(20,000): allow 5 of them
    assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / math.sqrt(len(gaps))


@pytest.mark.parametrize("bad, exc", [(dict(rate=0), ValueError), (dict(rate="1"), TypeError),
                                      (dict(num_requests=0), ValueError), (dict(seed=-1), ValueError)])  # fmt: skip
def test_poisson_arrivals_refuses_bad_input_by_name(bad, exc):
    args = dict(rate=1.0, num_requests=3, seed=0) | bad
    with pytest.raises(exc, match=next(iter(bad))):
        poisson_arrivals(**args)


def _event(step, start, tokens, seqs, duration, *, waiting=0, running=0, finished=0):
    per = [tokens // seqs] * seqs
    per[0] += tokens - sum(per)
    return StepEvent(step=step, start=start, duration=duration,
                     scheduled=tuple((i, 0, n, "decode") for i, n in enumerate(per)), admitted=(), preempted=(),
                     finished=tuple((i, 0) for i in range(finished)), num_free_blocks=0, num_waiting=waiting,
                     num_running=running, num_copies=0)  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_fit_step_cost_recovers_the_coefficients_of_noise_free_steps(seed):
    rng = np.random.default_rng(seed)
    true = StepCost(fixed_s=rng.uniform(0.01, 0.1), per_token_s=rng.uniform(1e-4, 2e-3), per_seq_s=rng.uniform(0, 5e-3))
    events = []
    for i in range(30):
        tokens, seqs = int(rng.integers(1, 200)), int(rng.integers(1, 16))
        tokens = max(tokens, seqs)
        events.append(_event(i, 0.0, tokens, seqs, true.seconds(tokens, seqs)))
    cost, r2 = fit_step_cost(events)
    for name in ("fixed_s", "per_token_s", "per_seq_s"):
        assert getattr(cost, name) == pytest.approx(getattr(true, name), rel=1e-6, abs=1e-12)
    assert r2 == pytest.approx(1.0)


def test_fit_step_cost_drops_a_term_that_would_come_out_negative():
    # durations that fall as sequences are added (for the same tokens) would need a negative per_seq_s
    events = [
        _event(i, 0.0, 64, s, 0.05 + 0.001 * 64 - 0.0001 * s + 0.0002 * (i % 3))
        for i, s in enumerate([1, 2, 4, 8, 16, 1, 2, 4, 8, 16])
    ]
    cost, _ = fit_step_cost(events)
    assert min(cost.fixed_s, cost.per_token_s, cost.per_seq_s) >= 0
    with pytest.raises(ValueError, match="events"):
        fit_step_cost(events[:2])


def test_one_request_alone_takes_exactly_the_modelled_steps(model):
    cost = StepCost(fixed_s=0.05, per_token_s=0.001, per_seq_s=0.002)
    prompt = list(range(3, 13))  # 10 tokens: within the step budget of 16
    params = SamplingParams(max_new_tokens=5, stop_token_ids=())
    engine = serve_open_loop(_make(model), [prompt], params, [1.5], cost)
    m = engine.stats["requests"][0]
    assert m.arrival_time == 1.5  # the clock jumped over the idle second and a half
    assert m.queue_time == 0
    assert m.ttft == pytest.approx(cost.seconds(len(prompt), 1))  # one prefill step (the prompt fits the budget)
    assert m.tpot == pytest.approx(cost.seconds(1, 1))  # then one decode step per token
    assert len(engine.events) == 5


@pytest.mark.parametrize("seed", range(3))
def test_open_loop_outputs_equal_solo_runs_and_arrivals_are_the_true_ones(model, seed):
    prompts = _prompts(seed, 10)
    params = SamplingParams(max_new_tokens=6, stop_token_ids=())
    arrivals = poisson_arrivals(20.0, len(prompts), seed=seed)
    engine = serve_open_loop(_make(model), prompts, params, arrivals, StepCost(0.02, 0.001))
    for i, p in enumerate(prompts):
        assert engine.output(i) == kvcourse.generate(model, p, max_new_tokens=6, eos_token_ids=())
        assert engine.stats["requests"][i].arrival_time == pytest.approx(arrivals[i])
        assert engine.stats["requests"][i].queue_time >= 0


@pytest.mark.parametrize("seed", range(3))
def test_littles_law_from_the_step_log_falls_short_by_less_than_a_step_per_request(model, seed):
    prompts = _prompts(seed, 12)
    params = SamplingParams(max_new_tokens=5, stop_token_ids=())
    engine = serve_open_loop(
        _make(model), prompts, params, poisson_arrivals(30.0, 12, seed=seed), StepCost(0.02, 0.001, 0.001)
    )
    point = LoadPoint.of(30.0, engine, ttft_slo=1.0, tpot_slo=1.0)
    span = len(prompts) / point.achieved_rate
    # sum of the time each request spent inside = L * span exactly; the log counts a request from the
    # first step that starts after it arrived, so it misses less than one step per request
    missed = (point.achieved_rate * point.mean_latency - point.mean_in_system) * span
    longest = max(e.duration for e in engine.events)
    assert 0 <= missed < len(prompts) * longest
    assert 0.5 < point.littles_law_ratio <= 1.0 + 1e-9


def _metrics(ttft: float, tpot: float, tokens: int = 3) -> RequestMetrics:
    m = RequestMetrics(arrival_time=0.0, arrival_step=0, num_prompt_tokens=4)
    m.first_token_time, m.finish_time, m.max_sample_tokens = ttft, ttft + tpot * (tokens - 1), tokens
    return m


def test_slo_attainment_needs_both_targets_and_goodput_is_the_highest_rate_meeting_the_target():
    ms = [_metrics(0.1, 0.05), _metrics(0.6, 0.05), _metrics(0.1, 0.2), _metrics(0.3, 0.0, tokens=1)]
    assert slo_attainment(ms, ttft_slo=0.5, tpot_slo=0.1) == 0.5  # the one-token answer is judged on TTFT
    with pytest.raises(ValueError, match="metrics"):
        slo_attainment([RequestMetrics(0.0, 0, 1)], 1.0, 1.0)
    points = [
        LoadPoint(rate=r, summary={}, attainment=a, achieved_rate=r, mean_in_system=1.0, mean_latency=1.0)
        for r, a in [(1, 1.0), (2, 0.95), (4, 0.85), (8, 0.91)]
    ]
    assert goodput(points, target=0.9) == 8  # the highest rate that meets it, even past a dip
    assert goodput(points, target=0.99) == 1
    assert goodput(points[2:3], target=0.9) == 0.0
    with pytest.raises(ValueError, match="target"):
        goodput(points, target=0)


def test_open_loop_refuses_arrivals_that_do_not_match_the_prompts(model):
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="arrivals"):
        serve_open_loop(_make(model), [[1, 2], [3, 4]], params, [0.0])
    with pytest.raises(ValueError, match="arrivals"):
        serve_open_loop(_make(model), [[1, 2], [3, 4]], params, [1.0, 0.5])
    with pytest.raises(ValueError, match=r"arrivals\[0\]"):
        serve_open_loop(_make(model), [[1, 2]], params, [-1.0])
    with pytest.raises(ValueError, match="span"):
        mean_in_system([_event(0, 0.0, 1, 1, 0.1)], 0.0)


def test_modelled_clock_moves_only_when_told():
    clock = ModelledClock()
    assert clock() == 0.0
    clock.advance(0.25)
    clock.advance_to(0.1)  # never backwards
    assert clock() == 0.25
    clock.advance_to(2.0)
    assert clock() == 2.0


# ---- refusals (issue 31, item 4): nothing hangs, nothing is accepted silently ---------------------------------
@pytest.mark.parametrize(("field", "value", "exc"), [
    ("fixed_s", float("nan"), ValueError), ("fixed_s", -0.05, ValueError), ("per_token_s", "0.1", TypeError),
    ("per_seq_s", float("inf"), ValueError),
])  # fmt: skip
def test_step_cost_refuses_what_is_not_a_non_negative_time(field, value, exc):
    kwargs = {"fixed_s": 0.01, "per_token_s": 0.001, "per_seq_s": 0.0, field: value}
    with pytest.raises(exc, match=f"StepCost.{field}"):
        StepCost(**kwargs)


def test_a_nan_cost_cannot_reach_the_open_loop(model):
    # it once never returned: the modelled clock kept max(nan, t) at NaN
    with pytest.raises(TypeError, match="cost must be a StepCost"):
        serve_open_loop(_make(model), [[1, 2]], SamplingParams(max_new_tokens=2), [0.0], (float("nan"), 0, 0))
    clock = ModelledClock()
    for call, value in ((clock.advance, float("nan")), (clock.advance, -1.0), (clock.advance_to, float("nan"))):
        with pytest.raises(ValueError):
            call(value)
    assert clock() == 0.0


def test_fit_step_cost_refuses_durations_that_are_not_times():
    good = [_event(i, 0.1 * i, 2 + i, 1, 0.01 + 0.001 * i) for i in range(5)]
    with pytest.raises(ValueError, match=r"events\[2\].duration"):
        fit_step_cost(good[:2] + [_event(2, 0.2, 3, 1, float("nan"))] + good[3:])
    with pytest.raises(ValueError, match=r"events\[0\].duration"):
        fit_step_cost([_event(i, 0.1 * i, 2 + i, 1, -0.01) for i in range(5)])
    with pytest.raises(ValueError, match="every duration is 0"):
        fit_step_cost([_event(i, 0.1 * i, 2 + i, 1, 0.0) for i in range(5)])


@pytest.mark.parametrize("slo", [float("nan"), -1.0, 0.0, "1"])
def test_slo_targets_must_be_positive_times(slo):
    ms = [_metrics(0.1, 0.05)]
    with pytest.raises((ValueError, TypeError), match="ttft_slo"):
        slo_attainment(ms, ttft_slo=slo, tpot_slo=0.1)
    with pytest.raises((ValueError, TypeError), match="tpot_slo"):
        slo_attainment(ms, ttft_slo=0.1, tpot_slo=slo)


def test_a_load_point_of_a_run_that_finished_nothing_or_took_no_time_says_so(model):
    params = SamplingParams(max_new_tokens=2, stop_token_ids=())
    engine = _make(model)(ModelledClock())
    with pytest.raises(ValueError, match="no finished request"):
        LoadPoint.of(1.0, engine, 1.0, 1.0)
    free = serve_open_loop(_make(model), [[1, 2, 3]], params, [0.0], StepCost(0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="finished the moment they arrived"):
        LoadPoint.of(1.0, free, 1.0, 1.0)
