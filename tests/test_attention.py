"""Contiguous reference attention: GQA semantics, the causal mask from positions, scale, dtype, strict checks."""

import math

import pytest
import torch

from kvcourse.kernels.reference import causal_attention, decode_attention_ref, repeat_kv


def _naive_attention(q, k, v, causal, q_offset=None, scale=None):
    """Loops over heads and positions: slow, obviously right."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    q_offset = s - t if q_offset is None else q_offset
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros_like(q)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(t):
                pos = q_offset + i
                limit = pos + 1 if causal else s
                scores = torch.stack([q[bi, h, i] @ k[bi, kh, j] for j in range(limit)]) * scale
                probs = torch.softmax(scores, 0)
                out[bi, h, i] = sum(probs[j] * v[bi, kh, j] for j in range(limit))
    return out


@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 4), (4, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("t,s", [(1, 1), (5, 5), (3, 7)])
def test_causal_attention_matches_loops(hq, hkv, t, s):
    g = torch.Generator().manual_seed(hq * 100 + t * 10 + s)
    q = torch.randn(2, hq, t, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, s, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, s, 8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(causal_attention(q, k, v), _naive_attention(q, k, v, causal=True))


@pytest.mark.parametrize("q_offset", [0, 1, 4])
@pytest.mark.parametrize("scale", [None, 0.05, 1.0])
def test_causal_attention_q_offset_and_scale(q_offset, scale):
    # Three queries at positions q_offset .. q_offset + 2 of a 7-key sequence: each sees keys up to its
    # own position, not "the last three keys", and the scores are multiplied by `scale`.
    g = torch.Generator().manual_seed(10 * q_offset + (0 if scale is None else int(100 * scale)))
    q = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64)
    got = causal_attention(q, k, v, scale=scale, q_offset=q_offset)
    torch.testing.assert_close(got, _naive_attention(q, k, v, True, q_offset, scale), rtol=1e-12, atol=1e-12)
    if q_offset != 4:  # 4 is the default: the queries are the last three keys
        assert not torch.allclose(got, causal_attention(q, k, v, scale=scale))


def test_float64_is_computed_in_float64():
    # A float64 reference must not round through float32 anywhere (it is the ground truth of tests).
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 5, 16, generator=g, dtype=torch.float64) * 30
    k = torch.randn(1, 2, 5, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 5, 16, generator=g, dtype=torch.float64)
    want = _naive_attention(q, k, v, causal=True)
    torch.testing.assert_close(causal_attention(q, k, v), want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(decode_attention_ref(q[:, :, -1], k, v), want[:, :, -1], rtol=1e-13, atol=1e-13)
    assert causal_attention(q, k, v).dtype == torch.float64


def test_causal_mask_hides_the_future():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    out = causal_attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 4:] += 10.0  # change only the last two tokens
    v2[:, :, 4:] -= 3.0
    out2 = causal_attention(q, k2, v2)
    torch.testing.assert_close(out[:, :, :4], out2[:, :, :4])  # earlier positions unaffected
    assert not torch.allclose(out[:, :, 4:], out2[:, :, 4:])


@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (6, 1)])
def test_decode_equals_last_row_of_causal(hq, hkv):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, hq, 10, 16, generator=g)
    k = torch.randn(3, hkv, 10, 16, generator=g)
    v = torch.randn(3, hkv, 10, 16, generator=g)
    full = causal_attention(q, k, v)
    torch.testing.assert_close(decode_attention_ref(q[:, :, -1], k, v), full[:, :, -1])


def test_decode_seq_lens_ignore_padding():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 8, generator=g)
    k = torch.randn(2, 2, 6, 8, generator=g)
    v = torch.randn(2, 2, 6, 8, generator=g)
    out = decode_attention_ref(q, k, v, seq_lens=[3, 6])
    torch.testing.assert_close(out[0], decode_attention_ref(q[:1], k[:1, :, :3], v[:1, :, :3])[0])
    k[0, :, 3:] = 1e4  # garbage in the padding must not matter
    torch.testing.assert_close(decode_attention_ref(q, k, v, seq_lens=[3, 6]), out)


def test_repeat_kv_maps_query_head_to_its_group():
    x = torch.arange(2).float().view(1, 2, 1, 1)
    assert repeat_kv(x, 3).flatten().tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    "make, exc, word",
    [
        (lambda: (torch.randn(1, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)), ValueError, "q"),
        (lambda: (torch.randn(1, 4, 3, 8), torch.randn(2, 5, 8), torch.randn(1, 2, 5, 8)), ValueError, "k"),
        (lambda: (torch.randn(1, 5, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)), ValueError, "multiple"),
        (
            lambda: (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8).double(), torch.randn(1, 2, 5, 8)),
            TypeError,
            "dtype",
        ),
        (lambda: ([1.0], torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)), TypeError, "q"),
        (lambda: (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 4, 8)), ValueError, "same shape"),
        (lambda: (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)), ValueError, "head_dim"),
        (
            lambda: (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None, 3),
            ValueError,
            "q_offset=3",
        ),
        (
            lambda: (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None, -1),
            ValueError,
            "q_offset",
        ),
        (lambda: (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), 0.0), ValueError, "scale"),
    ],
)
def test_causal_attention_rejects_bad_input(make, exc, word):
    with pytest.raises(exc, match=word):
        causal_attention(*make())


def test_decode_rejects_bad_input():
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match="rank"):
        decode_attention_ref(q[:, :, None], k, k)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention_ref(q, k, k, seq_lens=[0, 5])
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention_ref(q, k, k, seq_lens=[1, 6])
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention_ref(q, k, k, seq_lens=[1])
    if torch.device("meta") != q.device:
        with pytest.raises(ValueError, match="device"):
            decode_attention_ref(q, k.to("meta"), k.to("meta"))
