"""The torch pieces chapter 5 derives: the online softmax, the split-KV merge, and the roofline arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from kvcourse.kernels.online_softmax import merge_partials, online_softmax_attention
from kvcourse.kernels.roofline import GPU_PEAKS, decode_attention_bytes, decode_attention_flops


def _qkv(seed: int, g_heads: int, s: int, d: int = 16):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(g_heads, d, generator=gen, dtype=torch.float64) * 3,
        torch.randn(s, d, generator=gen, dtype=torch.float64),
        torch.randn(s, d, generator=gen, dtype=torch.float64),
    )


@pytest.mark.parametrize("tile", [1, 3, 16, 100])
def test_online_softmax_equals_softmax(tile):
    q, k, v = _qkv(tile, 3, 37)
    out, lse = online_softmax_attention(q, k, v, tile, scale=0.5)
    scores = 0.5 * q @ k.T
    torch.testing.assert_close(out, torch.softmax(scores, dim=-1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-12, atol=1e-12)


def test_online_softmax_survives_scores_that_overflow_exp():
    q, k, v = _qkv(1, 2, 20)
    out, _ = online_softmax_attention(q * 1000, k, v, tile=4)  # exp(score) alone would be inf
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.softmax(1000 * q @ k.T, dim=-1) @ v, rtol=1e-10, atol=1e-10)


def test_merge_of_splits_equals_whole_including_empty_splits():
    q, k, v = _qkv(3, 4, 50)
    bounds = [0, 0, 13, 31, 50, 50]  # splits 0 and 4 are empty
    parts = [online_softmax_attention(q, k[a:b], v[a:b], tile=8) for a, b in zip(bounds, bounds[1:])]
    assert math.isinf(parts[0][1][0].item()) and parts[0][1][0].item() < 0
    merged = merge_partials(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    whole, _ = online_softmax_attention(q, k, v, tile=64)
    torch.testing.assert_close(merged, whole, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="every split of some row is empty"):
        merge_partials(torch.zeros(2, 4, 16), torch.full((2, 4), float("-inf")))
    with pytest.raises(ValueError, match="tile must be a positive int"):
        online_softmax_attention(q, k, v, tile=0)


def test_online_softmax_and_merge_run_on_their_inputs_device(device):
    q, k, v = _qkv(5, 2, 30)
    out, lse = online_softmax_attention(q.to(device), k.to(device), v.to(device), tile=8)
    assert out.device.type == lse.device.type == device.type
    want, want_lse = online_softmax_attention(q, k, v, tile=8)
    torch.testing.assert_close((out.cpu(), lse.cpu()), (want, want_lse), rtol=1e-12, atol=1e-12)
    halves = [
        online_softmax_attention(q.to(device), k[a:b].to(device), v[a:b].to(device), tile=8)
        for a, b in ((0, 11), (11, 30))
    ]
    merged = merge_partials(torch.stack([o for o, _ in halves]), torch.stack([lse for _, lse in halves]))
    torch.testing.assert_close(merged.cpu(), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="q, k and v must be on one device"):
        online_softmax_attention(q, k.to("meta"), v, tile=8)
    with pytest.raises(ValueError, match="outs and lses must be on one device"):
        merge_partials(torch.zeros(2, 4, 16), torch.zeros(2, 4, device="meta"))


def test_decode_bytes_and_flops_counted_by_hand():
    # 2 sequences (100 and 28 tokens), 32 query / 8 KV heads, D = 128, fp16 cache and query, blocks of 16.
    kv = 2 * 128 * 8 * 128 * 2  # K and V: tokens x heads x dim x 2 bytes
    q_out = 2 * 2 * 32 * 128 * 2  # q read and output written
    tables = 4 * (7 + 2)  # ceil(100/16) + ceil(28/16) int32 entries
    assert decode_attention_bytes([100, 28], 32, 8, 128, kv_bytes=2, q_bytes=2, block_size=16) == kv + q_out + tables
    # int8 with one fp32 scale per token and head for K and for V.
    assert decode_attention_bytes([100], 32, 8, 128, kv_bytes=1, q_bytes=2, scale_bytes=4) == (
        2 * 100 * 8 * (128 + 4) + 2 * 32 * 128 * 2
    )
    assert decode_attention_flops([100, 28], 32, 128) == 4 * 128 * 32 * 128
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention_bytes([0], 1, 1, 1, 2, 2)


def test_decode_is_far_below_every_ridge_point():
    flops = decode_attention_flops([8192], 32, 128)
    intensity = flops / decode_attention_bytes([8192], 32, 8, 128, kv_bytes=2, q_bytes=2)
    assert 3.9 < intensity < 4.0  # ~ G = 4 FLOPs per byte in fp16
    assert GPU_PEAKS["H100-SXM"].ridge == pytest.approx(989e12 / 3.35e12)
    assert all(intensity < peak.ridge / 30 for peak in GPU_PEAKS.values())  # 38x (A100 80GB) to 74x below
