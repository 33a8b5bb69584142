"""Sequence, SamplingParams and the Sampler: one request's state and how its tokens are picked."""

from __future__ import annotations

import pytest
import torch

from kvcourse.sampling import Sampler
from kvcourse.sequence import SamplingParams, Sequence, SequenceStatus


def test_sequence_tracks_prompt_output_and_finishes_at_a_stop_token():
    seq = Sequence("r1", [5, 6, 7], SamplingParams(max_new_tokens=4), eos_token_ids=[2])
    assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
    seq.append_token(9)
    assert seq.token_ids == [5, 6, 7, 9] and seq.output_token_ids == [9] and seq.prompt_token_ids == [5, 6, 7]
    assert not seq.is_finished
    seq.append_token(2)  # the model's EOS
    assert seq.is_finished and seq.status is SequenceStatus.FINISHED and seq.num_tokens == 5


def test_sequence_finishes_at_max_new_tokens_and_honours_explicit_stops():
    seq = Sequence(0, [1], SamplingParams(max_new_tokens=2, stop_token_ids=()), eos_token_ids=[2])
    seq.append_token(2)  # not a stop token: stop_token_ids=() overrides EOS
    assert not seq.is_finished
    seq.append_token(3)
    assert seq.is_finished and seq.output_token_ids == [2, 3]
    seq = Sequence(0, [1], SamplingParams(max_new_tokens=9, stop_token_ids=[7]), eos_token_ids=[2])
    seq.append_token(7)
    assert seq.is_finished
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sequence(0, [])


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1"),
        (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int >= 1, got float"),
        (dict(temperature=-1), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature=float("inf")), ValueError, r"temperature must be a finite number >= 0, got inf"),
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(seed=1.5), TypeError, "seed"),
        (dict(seed=2**64), ValueError, r"seed must be an int in \[0, 18446744073709551615\], got 18446744073709551616"),
        (dict(seed=2**64 - 1, n=2), ValueError, r"seed must be an int in \[0, 18446744073709551614\]"),
        (dict(seed=-1), ValueError, "seed must be an int in"),
        (dict(stop_token_ids="eos"), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_the_largest_seeds_work():
    """Every sample's seed (seed + i) fits torch's 64-bit generator, the last one included."""
    for seed, n in ((2**64 - 1, 1), (2**64 - 3, 3)):
        params = SamplingParams(temperature=1.0, seed=seed, n=n)
        assert [Sampler(params, i)(torch.tensor([0.0, 0.0])) in (0, 1) for i in range(n)] == [True] * n


def test_greedy_sampler_takes_the_argmax():
    assert Sampler(SamplingParams())(torch.tensor([0.1, 3.0, -2.0])) == 1


def _draws(params, logits, n=400):
    sampler = Sampler(params)
    return [sampler(logits) for _ in range(n)]


def test_top_k_and_top_p_only_ever_pick_the_kept_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, seed=1), logits)) == {0, 1}
    # top_p = 0.8: tokens 0 and 1 already hold 0.8, so tokens 2 and 3 are cut.
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.8, seed=2), logits)) == {0, 1}
    # top_p = 0.81 needs token 2 as well.
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.81, seed=3), logits)) == {0, 1, 2}
    assert set(_draws(SamplingParams(temperature=1.0, seed=4), logits)) == {0, 1, 2, 3}


def test_sampling_follows_the_distribution_and_is_seeded():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    draws = _draws(SamplingParams(temperature=1.0, seed=11), logits, n=3000)
    freq = [draws.count(i) / len(draws) for i in range(3)]
    # 3000 draws: each frequency is within 4 standard deviations (sqrt(p(1-p)/n) <= 0.009) of p.
    assert all(abs(f - p) < 0.036 for f, p in zip(freq, (0.7, 0.2, 0.1)))
    assert draws[:50] == _draws(SamplingParams(temperature=1.0, seed=11), logits, n=50)
    assert draws[:50] != _draws(SamplingParams(temperature=1.0, seed=12), logits, n=50)
    # Temperature sharpens: at 0.25 the top token's probability is 0.7^4 / (0.7^4 + 0.2^4 + 0.1^4) = 0.997.
    cold = _draws(SamplingParams(temperature=0.25, seed=5), logits, n=1000)
    assert cold.count(0) >= 980
