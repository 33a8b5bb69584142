"""Exact work counts for naive and cached generation."""

import pytest

from kvcourse import LlamaConfig
from kvcourse.costs import (
    forward_flops,
    generation_flops,
    kv_projections_per_step,
    kv_projections_total,
    step_flops,
    tokens_fed,
)


@pytest.mark.parametrize("p,n", [(1, 1), (5, 20), (1, 1000), (100, 3), (7, 0)])
@pytest.mark.parametrize("use_cache", [False, True])
def test_closed_form_equals_sum_of_steps(p, n, use_cache):
    total = kv_projections_total(p, n, use_cache, num_layers=30)
    assert total == sum(kv_projections_per_step(p, i, use_cache, num_layers=30) for i in range(n))


def test_tokens_fed():
    assert tokens_fed(5, 0, use_cache=True) == (5, 0)  # prefill
    assert tokens_fed(5, 3, use_cache=True) == (1, 7)  # decode: token at position 7
    assert tokens_fed(5, 3, use_cache=False) == (8, 0)  # naive: everything again


def test_the_seed_500x_figure_is_the_projection_ratio_for_a_one_token_prompt():
    assert kv_projections_total(1, 1000, False) / kv_projections_total(1, 1000, True) == pytest.approx(500.5)
    # With a real prompt the ratio is much smaller: n P + n(n-1)/2 over P + n - 1.
    assert kv_projections_total(500, 1000, False) / kv_projections_total(500, 1000, True) < 670


def test_forward_flops_by_hand():
    cfg = LlamaConfig(
        vocab_size=10,
        hidden_size=4,
        intermediate_size=6,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=2,
    )
    # per token per layer: q 4x4, k 4x2, v 4x2, o 4x4, mlp 3 x 4x6 -> 2*(16+8+8+16+72) = 240
    # 3 tokens from position 0 see 1+2+3 = 6 keys: 2 (QK and PV) * 2 * 6 * q_dim(4) = 96 per layer
    assert forward_flops(cfg, 3, 0) == 2 * (3 * 240 + 96) + 2 * 3 * 4 * 10
    assert step_flops(cfg, 3, 0, use_cache=True) == forward_flops(cfg, 3, 0)


def test_cached_generation_does_less_work():
    cfg = LlamaConfig()
    naive, cached = generation_flops(cfg, 16, 64, False), generation_flops(cfg, 16, 64, True)
    assert naive > 10 * cached
    assert generation_flops(cfg, 16, 1, False) == generation_flops(cfg, 16, 1, True)  # step 0 is the same


def test_bad_arguments():
    with pytest.raises(ValueError, match="prompt_len"):
        kv_projections_total(0, 3, True)
    with pytest.raises(ValueError, match="new_tokens"):
        kv_projections_total(3, -1, True)


def test_flop_scaled_ms_scales_by_the_forward_flops():
    from kvcourse.costs import flop_scaled_ms

    cfg = LlamaConfig()
    # twice the tokens: more than twice the time (attention's pairs), less than four times
    assert 2 * 10.0 < flop_scaled_ms(cfg, 10.0, 100, 200) < 4 * 10.0
    assert flop_scaled_ms(cfg, 10.0, 100, 200) == pytest.approx(
        10.0 * forward_flops(cfg, 200) / forward_flops(cfg, 100)
    )
    assert flop_scaled_ms(cfg, 7.0, 64, 64) == pytest.approx(7.0)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((-1.0, 16, 384), "measured_ms"),
        ((1.0, 0, 384), "measured_tokens"),
        ((1.0, 16, 0), "num_tokens"),
        ((float("nan"), 16, 384), "measured_ms"),
    ],
)
def test_flop_scaled_ms_refuses_bad_input(args, name):
    from kvcourse.costs import flop_scaled_ms

    with pytest.raises((ValueError, TypeError), match=name):
        flop_scaled_ms(LlamaConfig(), *args)
