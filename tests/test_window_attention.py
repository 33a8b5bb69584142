"""Attention masked by key positions (chapter 8's seam): against loops, causal_attention and permutations."""

import math

import pytest
import torch

import kvcourse
from kvcourse.kernels.reference import causal_attention, position_masked_attention


def _loops(q, k, v, q_pos, k_pos, scale=None):
    """Per head and query: softmax over the keys whose position is <= the query's. Slow, obviously right."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros_like(q)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            pos = k_pos if k_pos.ndim == 1 else k_pos[bi, kh]
            for i in range(t):
                seen = [j for j in range(s) if pos[j] <= q_pos[i]]
                scores = torch.stack([q[bi, h, i] @ k[bi, kh, j] for j in seen]) * scale
                probs = torch.softmax(scores, 0)
                out[bi, h, i] = sum(p * v[bi, kh, j] for p, j in zip(probs, seen))
    return out


def _qkv(seed, b=2, hq=4, hkv=2, t=3, s=9, d=8):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, t, d, generator=g, dtype=torch.float64),
        torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64),
        torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64),
        g,
    )


@pytest.mark.parametrize("q_offset", [0, 2, 6])
def test_arange_positions_equal_causal_attention(q_offset):
    q, k, v, _ = _qkv(q_offset)
    got = position_masked_attention(q, k, v, torch.arange(q_offset, q_offset + 3), torch.arange(9))
    torch.testing.assert_close(got, causal_attention(q, k, v, q_offset=q_offset), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_keys_in_any_order_and_any_subset(seed):
    # A ring buffer returns keys out of order; a window or an eviction policy returns some of them.
    q, k, v, g = _qkv(seed)
    q_pos = torch.tensor([20, 21, 22])
    k_pos = torch.randperm(23, generator=g)[:9]
    k_pos[0] = 20  # every query must see at least one key
    got = position_masked_attention(q, k, v, q_pos, k_pos)
    torch.testing.assert_close(got, _loops(q, k, v, q_pos, k_pos), rtol=1e-12, atol=1e-12)
    perm = torch.randperm(9, generator=g)  # the order of the keys does not matter, only their positions
    torch.testing.assert_close(
        position_masked_attention(q, k[:, :, perm], v[:, :, perm], q_pos, k_pos[perm]), got, rtol=1e-12, atol=1e-12
    )


def test_positions_per_kv_head():
    q, k, v, g = _qkv(7)
    q_pos = torch.tensor([30, 31, 32])
    k_pos = torch.stack([torch.randperm(31, generator=g)[:9] for _ in range(4)]).view(2, 2, 9)
    k_pos[..., 0] = 30
    got, probs = position_masked_attention(q, k, v, q_pos, k_pos, scale=0.3, return_probs=True)
    torch.testing.assert_close(got, _loops(q, k, v, q_pos, k_pos, scale=0.3), rtol=1e-12, atol=1e-12)
    # The weights are a distribution over the visible keys, zero on the others.
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 3, dtype=torch.float64))
    hidden = k_pos.repeat_interleave(2, dim=1)[:, :, None, :] > q_pos[None, None, :, None]
    assert probs.shape == (2, 4, 3, 9) and bool((probs[hidden] == 0).all())


@pytest.mark.parametrize(
    ("args", "exc", "word"),
    [
        (lambda q, k, v: (q, k, v, torch.arange(3.0), torch.arange(9)), TypeError, "q_positions"),
        (lambda q, k, v: (q, k, v, torch.arange(3), [0] * 9), TypeError, "k_positions"),
        (lambda q, k, v: (q, k, v, torch.arange(4), torch.arange(9)), ValueError, "q_positions must have shape"),
        (lambda q, k, v: (q, k, v, torch.arange(3), torch.arange(8)), ValueError, "k_positions must have shape"),
        (lambda q, k, v: (q, k, v, torch.arange(3), torch.arange(9) + 5), ValueError, "sees no key"),
    ],
)
def test_bad_input_is_named(args, exc, word):
    q, k, v, _ = _qkv(0)
    with pytest.raises(exc, match=word):
        position_masked_attention(*args(q, k, v))


class _ShuffledCache(kvcourse.KVCache):
    """A full cache that returns its keys in a fixed shuffled order, with their positions."""

    def update(self, layer_idx, k, v):
        keys, values = super().update(layer_idx, k, v)
        self.perm = torch.randperm(keys.shape[2], generator=torch.Generator().manual_seed(keys.shape[2]))
        return keys[:, :, self.perm], values[:, :, self.perm]

    def key_positions(self, layer_idx):
        return self.perm


def test_the_model_masks_by_the_positions_a_cache_reports(model):
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 17, 2, 8]])
    want = model(ids, cache=kvcourse.KVCache.for_model(model.config))
    cache = _ShuffledCache.for_model(model.config)
    got = torch.cat(
        [model(ids[:, :5], cache=cache), model(ids[:, 5:6], cache=cache), model(ids[:, 6:], cache=cache)], 1
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))


class _WrongCount(kvcourse.KVCache):
    def key_positions(self, layer_idx):
        return torch.arange(self.keys(layer_idx).shape[2] + 1)


def test_a_cache_whose_positions_do_not_match_its_keys_is_refused(model):
    with pytest.raises(ValueError, match=r"key_positions\(0\) gives 4 positions but cache.update returned 3 keys"):
        model(torch.tensor([[1, 2, 3]]), cache=_WrongCount.for_model(model.config))
