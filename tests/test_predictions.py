"""The models chapters 5 and 7 predict with before they measure (issue 45)."""

import pytest

from kvcourse.bench.measured import load_kernel_bench
from kvcourse.kernels.roofline import decode_attention_bytes, int8_speedup_bound
from kvcourse.serving.load import StepCost
from kvcourse.serving.prefix_ttft import predicted_ttft_s, prefix_hit_tokens


def test_int8_speedup_bound_is_the_committed_runs_bytes_ratio():
    bench = load_kernel_bench("kernels-nvidia-h200-2026-11-26.json")
    s = bench.shape
    for b, c in bench.shapes():
        fp16, int8 = bench.row(b, c, "paged"), bench.row(b, c, "paged-int8")
        got = int8_speedup_bound([c] * b, s["num_q_heads"], s["num_kv_heads"], s["head_dim"], s["block_size"])
        assert got == pytest.approx(fp16["bytes"] / int8["bytes"], rel=1e-12)


def test_int8_speedup_bound_counts_the_scales_and_the_query():
    # long contexts: K/V dominate, 2D / (D + 4) per value
    assert int8_speedup_bound([100_000], 32, 8, 128) == pytest.approx(256 / 132, rel=1e-4)
    # one token: the fp16 query and output are a large share of both kernels' bytes
    assert int8_speedup_bound([1], 32, 8, 128) < 1.5
    assert int8_speedup_bound([512], 32, 8, 128) < 2.0
    with pytest.raises(ValueError, match="seq_lens"):
        int8_speedup_bound([], 32, 8, 128)
    assert decode_attention_bytes([16], 1, 1, 8, kv_bytes=1, q_bytes=2, scale_bytes=4) == 2 * 16 * 12 + 2 * 8 * 2


@pytest.mark.parametrize(
    "prompt_len, cached, block, hit",
    [
        (107, 94, 16, 80),
        (32, 32, 16, 16),
        (33, 32, 16, 32),
        (32, 100, 16, 16),
        (5, 0, 4, 0),
        (10, 9, 1, 9),
        (10, 10, 1, 9),
    ],
)
def test_prefix_hit_tokens_whole_blocks_never_the_last_tokens_block(prompt_len, cached, block, hit):
    assert prefix_hit_tokens(prompt_len, cached, block) == hit


def test_predicted_ttft_charges_the_fed_tokens_to_one_step():
    cost = StepCost(0.05, 0.001, 0.002)
    assert predicted_ttft_s(cost, 107, 94, 16) == pytest.approx(0.05 + 0.001 * 27 + 0.002)
    assert predicted_ttft_s(cost, 107, 0, 16) == pytest.approx(0.05 + 0.001 * 107 + 0.002)
    with pytest.raises(TypeError, match="step_cost"):
        predicted_ttft_s((0.05, 0.001), 107, 94, 16)
    for bad in ({"prompt_len": 0}, {"cached_tokens": -1}, {"block_size": 0}):
        args = {"prompt_len": 10, "cached_tokens": 4, "block_size": 4} | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            prefix_hit_tokens(**args)


def test_rounding_mse_predicts_what_the_quantizer_measures():
    import torch

    from kvcourse.compression.quantization import fake_quantize, rounding_mse

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    for bits in (4, 8):
        measured = (fake_quantize(x, f"int{bits}") - x).pow(2).mean().item()
        assert rounding_mse(x, bits) == pytest.approx(measured, rel=0.1)
    # groups along the other axis: other ranges, another prediction
    assert rounding_mse(x, 4, dim=0) != rounding_mse(x, 4)
    step = (x.amax(-1) - x.amin(-1)) / 15
    assert rounding_mse(x, 4) == pytest.approx((step**2 / 12).mean().item())
    with pytest.raises(ValueError, match="bits"):
        rounding_mse(x, 0)
    with pytest.raises(TypeError, match="x must"):
        rounding_mse([1.0, 2.0], 4)
