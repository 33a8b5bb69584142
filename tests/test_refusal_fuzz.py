"""Random bad values at the public hooks and models of issue 31, seeded and bounded to seconds.

Each value is either refused with an error that names the argument, or accepted and used; a refusal changes
nothing; and an engine whose hooks were refused mid-run still gives every request the tokens it gets alone.
"""

from __future__ import annotations

import math
import random

import pytest

from kvcourse import SamplingParams
from kvcourse.memory import kv_layout
from kvcourse.paged import RadixCache
from kvcourse.serving import Engine
from kvcourse.serving.load import ModelledClock, StepCost, slo_attainment
from kvcourse.serving.scheduler import preempt_newest

from .conftest import tiny_llama
from .test_load import _metrics
from .test_prefix_lookup_hook import walk

BAD = [None, "x", -1, -3, 0, 2.5, float("nan"), float("inf"), -float("inf"), [], {}, (), object(), True,
       10**30, "1", [1, "a"], [-1], [10**9]]  # fmt: skip
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0, stop_token_ids=())


def _refused_by_name(call, *names: str) -> bool:
    """True if ``call()`` raised a TypeError / ValueError naming one of ``names``; False if it returned."""
    try:
        call()
    except (TypeError, ValueError) as exc:
        assert any(n in str(exc) for n in names), f"{exc!r} names none of {names}"
        return True
    return False


@pytest.mark.parametrize("seed", range(3))
def test_models_refuse_bad_values_by_name_or_use_them(seed):
    rnd = random.Random(seed)
    for _ in range(60):
        field, value = rnd.choice(["fixed_s", "per_token_s", "per_seq_s"]), rnd.choice(BAD)
        kwargs = {"fixed_s": 0.01, "per_token_s": 0.001, "per_seq_s": 0.0, field: value}
        if not _refused_by_name(lambda: StepCost(**kwargs), f"StepCost.{field}"):
            assert math.isfinite(StepCost(**kwargs).seconds(4, 2))  # accepted: a usable cost
        clock = ModelledClock()
        if not _refused_by_name(lambda: clock.advance(value), "seconds"):
            assert math.isfinite(clock()) and clock() >= 0
        if not _refused_by_name(lambda: slo_attainment([_metrics(0.1, 0.05)], value, 1.0), "ttft_slo"):
            assert slo_attainment([_metrics(0.1, 0.05)], value, 1.0) in (0.0, 1.0)
        cache = RadixCache()
        cache.insert([1, 2, 3])
        before = cache.format()
        if not _refused_by_name(lambda: cache.evict(value), "num_tokens"):
            assert isinstance(value, int) and value >= 0
        else:
            assert cache.format() == before and len(cache) == 3
        assert _refused_by_name(lambda: cache.lock(value), "node")
        key = rnd.choice(["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                          "sliding_window", "max_window_layers"])  # fmt: skip
        config = {"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                  "head_dim": 16, "sliding_window": 64, "use_sliding_window": True, key: value}  # fmt: skip
        if not _refused_by_name(lambda: kv_layout(config), key, "layer count", "head", "sliding"):
            layout = kv_layout(config)
            assert 1 <= layout.num_layers <= 10_000 and len(layout.layer_windows) == layout.num_layers


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


def _prompts(rnd: random.Random) -> list[list[int]]:
    shared = [rnd.randrange(4, 100) for _ in range(8)]
    return [shared + [rnd.randrange(4, 100) for _ in range(rnd.randint(0, 6))] for _ in range(3)]


@pytest.mark.parametrize("seed", range(2))
def test_an_engine_whose_hooks_answer_nonsense_still_serves_every_request_as_alone(model, seed):
    rnd = random.Random(100 + seed)
    prompts = _prompts(rnd)
    solo = []
    for p in prompts:
        alone = Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True)
        alone.add_request(p, PARAMS, request_id=0)
        while alone.has_unfinished_requests():
            alone.step()
        solo.append(alone.requests[0].outputs)

    def policy(candidates):
        return rnd.choice(BAD) if rnd.random() < 0.3 else preempt_newest(candidates)

    def lookup(*args):
        return rnd.choice(BAD) if rnd.random() < 0.3 else walk(*args)

    engine = Engine(model, num_blocks=10, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True,
                    preemption_policy=policy)  # fmt: skip
    engine.block_manager.find_longest_cache_hit = lookup
    for i, p in enumerate(prompts):
        engine.add_request(p, PARAMS, request_id=i)
    refused = steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 1000
        free = engine.block_manager.num_free_blocks
        try:
            engine.step()
        except (TypeError, ValueError) as exc:
            refused += 1
            assert "preemption_policy" in str(exc) or "find_longest_cache_hit" in str(exc), exc
            assert engine.block_manager.num_free_blocks == free  # nothing reserved by the refused step
    assert refused > 0
    assert [engine.requests[i].outputs for i in range(len(prompts))] == solo
