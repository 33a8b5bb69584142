"""The request-trace simulator: hand-checked runs, invariants (property tests), bad input."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.fragmentation import (
    Request,
    _ContiguousPool,
    block_size_sweep,
    make_trace,
    reserved_slots,
    simulate,
)

# ---- hand-checked runs --------------------------------------------------------------


def test_max_reservation_by_hand():
    # r0 holds all 8 slots for 2 steps while r1 waits; then r1 runs alone.
    trace = [Request(0, 0, 3, 2), Request(1, 0, 1, 1)]
    res = simulate(trace, 8, "max", max_len=8)
    assert res.steps == 3 and res.saturated_steps == 2
    assert res.live_series.tolist() == [4, 5, 2]
    assert res.allocated_series.tolist() == [8, 8, 8]
    assert res.finish_step == {0: 1, 1: 2}
    # saturated steps: live 4 + 5, reserved (5-4) + 0, internal 3 + 3, of 2 x 8 slots
    assert res.live_frac == pytest.approx(9 / 16)
    assert res.reserved_frac == pytest.approx(1 / 16)
    assert res.internal_frac == pytest.approx(6 / 16)
    assert res.external_frac == 0
    assert res.mean_running == 1


def test_paged_by_hand():
    # 3 prompt tokens + first output token fill one 4-slot block; the next token needs a second block.
    res = simulate([Request(0, 0, 3, 3)], 8, "paged", block_size=4, watermark=0.0)
    assert res.live_series.tolist() == [4, 5, 6]
    assert res.allocated_series.tolist() == [4, 8, 8]
    assert res.saturated_steps == 0  # nobody waited: averaged over all 3 steps
    assert res.live_frac == pytest.approx(15 / 24)
    assert res.mean_block_table_len == pytest.approx(5 / 3)


def test_paged_preempts_latest_and_recomputes():
    # Two requests (prompt 1, output 3) in a pool of 2 blocks of 2 slots, derived by hand:
    # step 0: both admitted, one block each (prompt + its first token = 2 slots); pool full.
    # step 1: request 0 needs a second block; request 1, the latest admitted, is preempted
    #         (1 preemption, its 2 tokens to recompute) and request 0 takes the freed block.
    # step 2: request 0 writes its third token and finishes, freeing both blocks.
    # step 3: request 1 is re-admitted with 3 tokens (2 blocks); step 4: its third token, finished.
    trace = [Request(0, 0, 1, 3), Request(1, 0, 1, 3)]
    res = simulate(trace, 4, "paged", block_size=2, watermark=0.0)
    assert res.preemptions == 1 and res.recomputed_tokens == 2
    assert res.finish_step == {0: 2, 1: 4}
    assert res.peak_allocated == 4


def test_reserved_slots():
    r = Request(0, 0, 100, 29)  # 129 tokens
    assert reserved_slots(r, "max", 2048) == 2048
    assert reserved_slots(r, "pow2", 2048) == 256
    assert reserved_slots(Request(0, 0, 100, 28), "pow2", 2048) == 128
    assert reserved_slots(Request(0, 0, 1500, 100), "pow2", 2000) == 2000  # capped at max_len
    assert reserved_slots(r, "oracle", 2048) == 129
    with pytest.raises(ValueError, match="strategy"):
        reserved_slots(r, "paged", 2048)


def test_contiguous_pool_first_fit_and_merge():
    pool = _ContiguousPool(10, contiguous=True)
    a, b, c = pool.alloc(3), pool.alloc(3), pool.alloc(3)
    assert (a, b, c) == (0, 3, 6)
    pool.free(b, 3)
    assert pool.alloc(4) is None  # 4 free slots, but not in one piece
    assert pool.free_total == 4
    pool.free(a, 3)
    pool.free(c, 3)
    assert pool.free_starts == [0] and pool.free_lens == [10]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=30), st.randoms())
def test_contiguous_pool_never_overlaps(sizes, rnd):
    pool = _ContiguousPool(32, contiguous=True)
    held = []
    for n in sizes:
        if held and rnd.random() < 0.4:
            pool.free(*held.pop(rnd.randrange(len(held))))
        start = pool.alloc(n)
        if start is not None:
            held.append((start, n))
        used = np.zeros(32, dtype=int)
        for s, m in held:
            used[s : s + m] += 1
        assert used.max() <= 1
        assert pool.free_total == 32 - used.sum()


# ---- the trace ------------------------------------------------------------------------


def test_trace_is_seeded_and_bounded():
    a, b, c = make_trace(500, seed=3), make_trace(500, seed=3), make_trace(500, seed=4)
    assert a == b and a != c
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.total_len <= 2048 for r in a)


def test_trace_means_match_the_documented_defaults():
    trace = make_trace(20000, seed=0)
    assert np.mean([r.prompt_len for r in trace]) == pytest.approx(165, rel=0.1)
    assert np.mean([r.output_len for r in trace]) == pytest.approx(330, rel=0.1)
    # Poisson arrivals at 1 request per step: the last arrival is near step 20000
    assert trace[-1].arrival == pytest.approx(20000, rel=0.05)


# ---- invariants -------------------------------------------------------------------------

small_traces = st.builds(
    lambda n, seed, rate: make_trace(n, seed, arrival_rate=rate, max_len=256, prompt_median=30, output_median=40),
    st.integers(1, 40),
    st.integers(0, 10_000),
    st.sampled_from([0.05, 0.5, 5.0]),
)
configs = st.sampled_from(
    [("max", None), ("pow2", None), ("oracle", None), ("paged", 1), ("paged", 7), ("paged", 16), ("paged", 64)]
)


@settings(max_examples=60, deadline=None)
@given(small_traces, configs, st.sampled_from([512, 600, 1024]), st.booleans())
def test_invariants(trace, config, pool, contiguous):
    strategy, block_size = config
    kwargs = {} if strategy == "paged" else {"contiguous": contiguous}
    res = simulate(trace, pool, strategy, block_size, max_len=256, **kwargs)
    # never over capacity, and every token that is live has a slot
    assert res.peak_allocated <= pool
    assert (res.live_series <= res.allocated_series).all()
    # every request finishes, no earlier than its arrival plus its output length
    assert set(res.finish_step) == {r.req_id for r in trace}
    for r in trace:
        assert res.finish_step[r.req_id] >= r.arrival + r.output_len - 1
    # a breakdown of the whole pool
    parts = res.breakdown()
    assert all(0 <= v <= 1 for v in parts.values())
    assert math.isclose(sum(parts.values()), 1.0, abs_tol=1e-9)
    assert 0 < res.live_over_allocated <= 1
    if strategy != "paged":
        assert res.preemptions == 0
    if strategy == "paged" and block_size == 1:
        assert res.reserved_frac == res.internal_frac == 0 and res.live_over_allocated == 1
    if strategy == "oracle":
        assert res.internal_frac == 0


@settings(max_examples=15, deadline=None)
@given(small_traces, configs)
def test_deterministic(trace, config):
    a = simulate(trace, 600, config[0], config[1], max_len=256)
    b = simulate(list(trace), 600, config[0], config[1], max_len=256)
    assert a.breakdown() == b.breakdown() and a.finish_step == b.finish_step
    assert (a.live_series == b.live_series).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_strategy_ordering_on_a_fixed_trace(seed):
    trace = make_trace(300, seed)
    util = {s: simulate(trace, 16384, s).live_frac for s in ("max", "pow2", "oracle")}
    paged = simulate(trace, 16384, "paged", 1).live_frac
    assert util["max"] <= util["pow2"] <= util["oracle"] < paged
    # paging at block size 1 wastes only the free blocks it keeps for growth
    assert paged > 0.95


def test_block_size_trade_off():
    trace = make_trace(300, seed=0)
    sweep = block_size_sweep(trace, 16384, [1, 16, 256])
    live = [r.live_frac for r in sweep]
    assert live[0] >= live[1] > live[2]
    tables = [r.mean_block_table_len for r in sweep]
    assert tables[0] > 10 * tables[1] > 100 * tables[2] / 16


def test_removing_contiguity_removes_most_external_fragmentation():
    trace = make_trace(300, seed=0)
    with_gaps = simulate(trace, 16384, "oracle")
    without = simulate(trace, 16384, "oracle", contiguous=False)
    assert without.external_frac < with_gaps.external_frac
    assert without.live_frac > with_gaps.live_frac


def test_snapshot_matches_series():
    trace = make_trace(100, seed=0)
    res = simulate(trace, 8192, "max", snapshot_step=50)
    assert sum(r["live"] for r in res.snapshot) == res.live_series[50]
    assert sum(r["allocated"] for r in res.snapshot) == res.allocated_series[50]
    assert all(r["allocated"] == 2048 for r in res.snapshot)


def test_watermark_trades_concurrency_for_preemptions():
    trace = make_trace(300, seed=0)
    low = simulate(trace, 16384, "paged", 16, watermark=0.0)
    high = simulate(trace, 16384, "paged", 16, watermark=0.2)
    assert high.preemptions < low.preemptions
    assert high.mean_running < low.mean_running


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"num_requests": 0}, ValueError, "num_requests"),
        ({"num_requests": 5, "seed": "a"}, TypeError, "seed"),
        ({"num_requests": 5, "arrival_rate": 0}, ValueError, "arrival_rate"),
        ({"num_requests": 5, "max_len": 1}, ValueError, "max_len"),
        ({"num_requests": 5, "prompt_sigma": -1}, ValueError, "prompt_sigma"),
    ],
)
def test_make_trace_rejects_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        make_trace(**kwargs)


def test_simulate_rejects_bad_input():
    trace = make_trace(5, seed=0, max_len=256)
    with pytest.raises(TypeError, match="trace"):
        simulate([1, 2], 1024, "max")
    with pytest.raises(TypeError, match="trace"):
        simulate([], 1024, "max")
    with pytest.raises(ValueError, match="strategy"):
        simulate(trace, 1024, "lru")
    with pytest.raises(ValueError, match="block_size is required"):
        simulate(trace, 1024, "paged")
    with pytest.raises(ValueError, match="block_size"):
        simulate(trace, 1024, "max", 16)
    with pytest.raises(ValueError, match="block_size"):
        simulate(trace, 1024, "paged", 0)
    with pytest.raises(ValueError, match="pool_tokens"):
        simulate(trace, 0, "max")
    with pytest.raises(ValueError, match="pool_tokens"):
        simulate(trace, 1000, "max")  # cannot hold one 2048-slot reservation
    with pytest.raises(ValueError, match="max_len"):
        simulate([Request(0, 0, 300, 10)], 4096, "oracle", max_len=256)
    with pytest.raises(ValueError, match="watermark"):
        simulate(trace, 1024, "paged", 16, watermark=1.5)
    with pytest.raises(ValueError, match="max_running"):
        simulate(trace, 4096, "max", max_running=0)
    with pytest.raises(ValueError, match="block_sizes"):
        block_size_sweep(trace, 1024, [])


def test_max_running_caps_the_batch():
    trace = make_trace(50, seed=0, max_len=256)
    res = simulate(trace, 100_000, "paged", 16, max_len=256, max_running=3)
    assert res.max_running == 3


# ---- the pools behind the simulator: numbers recorded before they became PagedPool / ReservationPool ----
@pytest.mark.parametrize(
    "kwargs, want",
    [
        (dict(strategy="max"),
         (877, 728, 0.390995235234, 0.267745804001, 0.341258960766, 0.0, 4.0,
          4, 1024, 0, 0, 16241, 829440, 1536)),
        (dict(strategy="pow2"),
         (866, 717, 0.400991272228, 0.26840078016, 0.147836852772, 0.18277109484, 3.997210599721,
          6, 992, 0, 0, 16010, 684752, 1472)),
        (dict(strategy="oracle"),
         (744, 594, 0.487209332912, 0.336305765993, 0.0, 0.176484901094, 4.984848484848,
          8, 998, 0, 0, 11826, 551274, 2843)),
        (dict(strategy="oracle", contiguous=False),
         (687, 537, 0.533528645833, 0.373950695414, 0.0, 0.092520658752, 5.506517690875,
          8, 1024, 0, 0, 10923, 551274, -7)),
        (dict(strategy="paged", block_size=16),
         (425, 199, 0.898093985553, 0.067240499372, 0.005849560302, 0.028815954774, 9.934673366834,
          18, 1024, 37, 1790, 6666, 354384, -18)),
        (dict(strategy="paged", block_size=4, watermark=0.1),
         (407, 199, 0.908649693781, 0.014471772927, 0.000363143844, 0.076515389447, 10.090452261307,
          18, 1024, 9, 507, 6585, 335036, -18)),
        (dict(strategy="paged", block_size=16, max_running=5),
         (704, 555, 0.451194749437, 0.034149774775, 0.002549619932, 0.512105855856, 5.0,
          5, 960, 0, 0, 13048, 354384, -5)),
    ],
)  # fmt: skip
def test_simulator_pools_reproduce_the_recorded_runs(kwargs, want):
    trace = make_trace(40, seed=3, prompt_median=30, output_median=50, max_len=256)
    r = simulate(trace, 1024, max_len=256, snapshot_step=30, **kwargs)
    got = (r.steps, r.saturated_steps, r.live_frac, r.reserved_frac, r.internal_frac, r.external_frac,
           r.mean_running, r.max_running, r.peak_allocated, r.preemptions, r.recomputed_tokens,
           sum(r.finish_step.values()), int(r.allocated_series.sum()),
           sum(d["offset"] for d in r.snapshot))  # fmt: skip
    assert got == pytest.approx(want, abs=1e-11)
    assert int(r.live_series.sum()) == 330168 and int(r.running_series.sum()) == 3240  # the same tokens served


def test_reservation_live_fraction_by_hand():
    from kvcourse.fragmentation import reservation_live_fraction

    # one request, prompt 10, output 4: it holds 11, 12, 13, 14 tokens over its 4 steps, of 100 reserved
    assert reservation_live_fraction([10], [4], 100) == pytest.approx(12.5 / 100)
    # a long request runs longer, so it counts for more than its share of the trace
    two = reservation_live_fraction([10, 10], [2, 8], 100)
    assert two == pytest.approx((2 * 11.5 + 8 * 14.5) / 10 / 100)
    assert two > np.mean([11.5, 14.5]) / 100


def test_reservation_live_fraction_predicts_the_max_simulation():
    # chapter 4's trace: the model lands within 3% of the simulated live fraction of max-length reservations
    from kvcourse.fragmentation import reservation_live_fraction

    trace = make_trace(1000, seed=0, max_len=2048)
    model = reservation_live_fraction([r.prompt_len for r in trace], [r.output_len for r in trace], 2048)
    measured = simulate(trace, 32 * 1024, "max", max_len=2048).live_over_allocated
    assert abs(measured / model - 1) < 0.03


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (([1], [1], 0), "max_len"),
        (([1, 2], [1], 10), "prompt_lens"),
        (([0], [1], 10), "prompt_lens"),
        (([5], [6], 10), "max_len"),
    ],
)
def test_reservation_live_fraction_refuses_bad_input(args, name):
    from kvcourse.fragmentation import reservation_live_fraction

    with pytest.raises(ValueError, match=name):
        reservation_live_fraction(*args)
