"""Chapter 8's checks accept right answers and reject each typical wrong answer with its own hint.

The wrong answers are written the way a learner would write them, independently of the checks.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvcourse.compression.dropping import DroppingKVCache, select_tokens
from kvcourse.compression.quantization import fake_quantize
from kvcourse.compression.window import ring_slot
from kvcourse.exercises import ExerciseError, ch08


# ---- 1. a quantizer ------------------------------------------------------------------------------
def quantizer(x, bits):
    lo = x.min(dim=-1, keepdim=True).values
    hi = x.max(dim=-1, keepdim=True).values
    scale = (hi - lo) / (2**bits - 1)
    scale[scale == 0] = 1.0
    q = ((x - lo) / scale).round().clamp(0, 2**bits - 1)
    return q * scale + lo


def quantizer_loops(x, bits):
    out = torch.empty_like(x)
    for idx in range(x.reshape(-1, x.shape[-1]).shape[0]):
        row = x.reshape(-1, x.shape[-1])[idx].tolist()
        lo, hi = min(row), max(row)
        step = (hi - lo) / (2**bits - 1) or 1.0
        out.view(-1, x.shape[-1])[idx] = torch.tensor([lo + round((v - lo) / step) * step for v in row])
    return out


def test_quantizer_accepts_right_answers(device):
    assert ch08.check_quantizer(quantizer, device=device)
    assert ch08.check_quantizer(quantizer_loops, seed=3, device=device)


def _levels_pow2(x, bits):
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / 2**bits
    return ((x - lo) / scale).round().clamp(0, 2**bits - 1) * scale + lo


def _floor(x, bits):
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    return torch.floor((x - lo) / scale) * scale + lo


def _global_range(x, bits):
    lo, hi = x.min(), x.max()
    scale = (hi - lo) / (2**bits - 1)
    return ((x - lo) / scale).round() * scale + lo


def _no_zero(x, bits):
    scale = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2**bits - 1)
    return (x / scale).round().clamp(0, 2**bits - 1) * scale


def _symmetric(x, bits):
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(-1, keepdim=True) / qmax
    return (x / scale).round().clamp(-qmax, qmax) * scale


def _codes(x, bits):
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    return ((x - lo) / ((hi - lo) / (2**bits - 1))).round()


def _nan_on_constant(x, bits):
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    return ((x - lo) / scale).round() * scale + lo


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (_levels_pow2, r"2\*\*b - 1 steps"),
        (_floor, "instead of truncating"),
        (_global_range, "One scale and zero point per row"),
        (_no_zero, "Subtract the zero point"),
        (_symmetric, "symmetric quantization"),
        (_codes, "not the codes"),
        (_nan_on_constant, "constant row"),
        (lambda x, bits: x.T, "shape"),
        (lambda x, bits: x * 1.01, r"scale = \(max - min\) / \(2\*\*bits - 1\)"),
    ],
)
def test_quantizer_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch08.check_quantizer(wrong)


def test_quantizer_refuses_the_package_own():
    with pytest.raises(ExerciseError, match="fake_quantize"):
        ch08.check_quantizer(lambda x, bits: fake_quantize(x, f"int{bits}"))


# ---- 2. the ring with sinks ----------------------------------------------------------------------
def slot_for(pos, num_sinks, window):
    if pos < num_sinks:
        return pos
    return num_sinks + (pos - num_sinks) % window


def slot_rotated(pos, num_sinks, window):  # another valid ring: token p still overwrites p - window
    return pos if pos < num_sinks else num_sinks + pos % window


def test_ring_accepts_right_answers(model_on):
    assert ch08.check_ring_slot(slot_for)
    assert ch08.check_ring_slot(slot_rotated, seed=5)
    assert ch08.check_ring_slot(slot_for, model_on)  # the ring runs on the model's device


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda p, s, w: p % (s + w), "sinks were overwritten"),
        (lambda p, s, w: p if p < s else p % w, "ring ignores the sinks"),
        (lambda p, s, w: min(p, s + w - 1), "oldest"),
        (lambda p, s, w: s + (p - s) % (w + 1) if p >= s else p, "a slot in 0 .. "),
        (lambda p, s, w: s + (p - s) % max(w - 1, 1) if p >= s else p, "the last `window` positions"),
        (lambda p, s, w: float(slot_for(p, s, w)), "should return an int"),
    ],
)
def test_ring_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch08.check_ring_slot(wrong)


def test_ring_refuses_the_package_own():
    with pytest.raises(ExerciseError, match="ring_slot"):
        ch08.check_ring_slot(ring_slot)
    with pytest.raises(ExerciseError, match="ring_slot"):
        ch08.check_ring_slot(lambda p, s, w: ring_slot(p, s, w))


# ---- 3. SnapKV's scores --------------------------------------------------------------------------
def snapkv_keep(probs, num_kv_heads, budget, window, kernel):
    num_heads, seq_len, _ = probs.shape
    group = num_heads // num_kv_heads
    votes = probs[:, seq_len - window :, :].sum(dim=1)
    votes = torch.stack([votes[j * group : (j + 1) * group].sum(0) for j in range(num_kv_heads)])
    pooled = torch.nn.functional.max_pool1d(votes.unsqueeze(1), kernel, 1, kernel // 2).squeeze(1)
    pooled[:, seq_len - window :] = float("inf")
    return torch.sort(torch.topk(pooled, budget).indices).values


def test_snapkv_reference_is_what_the_cache_keeps():
    gen = torch.Generator().manual_seed(0)
    for num_heads, num_kv_heads, s, budget, window, kernel in [
        (4, 2, 60, 30, 8, 7),
        (9, 3, 80, 20, 16, 5),
        (6, 1, 50, 45, 4, 3),
    ]:
        probs = ch08._attention_probs(gen, num_heads, s)
        assert torch.allclose(probs.sum(-1), torch.ones(num_heads, s))
        want = ch08._package_keep(probs, num_kv_heads, budget, window, kernel)
        got = ch08._snapkv_keep(probs, num_kv_heads, budget, window, kernel)
        assert ch08._same_keep(got, want, ch08._snapkv_ranked(probs, num_kv_heads, window, kernel))


def test_snapkv_right_answers_pass(device):
    assert ch08.check_snapkv_keep(snapkv_keep, device=device)
    assert ch08.check_snapkv_keep(snapkv_keep, seed=4, device=device)


@pytest.mark.parametrize(
    "mistake,hint",
    [
        ("all_queries", "H2O's heavy-hitter score"),
        ("no_pool", "Max-pool the scores"),
        ("no_window", "Keep the observation window's own"),
        ("interleaved", "consecutive heads"),
        ("unsorted", "Sort each KV head's kept positions"),
    ],
)
def test_snapkv_mistakes_get_their_hint(mistake, hint):
    def wrong(probs, num_kv_heads, budget, window, kernel):
        num_heads, seq_len, _ = probs.shape
        rows = probs if mistake == "all_queries" else probs[:, seq_len - window :]
        votes = rows.sum(1)
        if mistake == "interleaved":  # heads j, j + num_kv_heads, ... as if torch.repeat had laid them out
            votes = torch.stack([votes[j::num_kv_heads].sum(0) for j in range(num_kv_heads)])
        else:
            votes = votes.reshape(num_kv_heads, -1, seq_len).sum(1)
        if mistake != "no_pool":
            votes = torch.nn.functional.max_pool1d(votes[:, None], kernel, 1, kernel // 2)[:, 0]
        if mistake != "no_window":
            votes[:, -window:] = votes.max() + 1
        keep = votes.topk(budget).indices
        return keep if mistake == "unsorted" else keep.sort().values

    with pytest.raises(ExerciseError, match=re.escape(hint)):
        ch08.check_snapkv_keep(wrong)


def snapkv_as_the_paper_pools(probs, num_kv_heads, budget, window, kernel):
    """SnapKV's own code: the window's votes for the prefix only, pooled on their own, then the window appended."""
    num_heads, seq_len, _ = probs.shape
    votes = probs[:, -window:, :-window].sum(1).reshape(num_kv_heads, -1, seq_len - window).sum(1)
    pooled = torch.nn.functional.max_pool1d(votes[:, None], kernel, 1, kernel // 2)[:, 0]
    keep = pooled.topk(budget - window).indices
    window_positions = torch.arange(seq_len - window, seq_len, device=probs.device).expand(num_kv_heads, window)
    return torch.cat([keep, window_positions], -1).sort(-1).values


@pytest.mark.parametrize("seed", [0, 1, 4])
def test_snapkv_prefix_only_pooling_gets_its_hint_and_the_first_difference(seed):
    """Issue 47: the exercise says the window's own votes enter the pooling; the paper's way is told so, and the
    message shows where expected and got part (both used to print as [0, 1, 2, 3, ...])."""
    with pytest.raises(ExerciseError) as exc:
        ch08.check_snapkv_keep(snapkv_as_the_paper_pools, seed=seed, device="cpu")
    assert "the observation window's own tokens included" in exc.value.hint, exc.value.hint
    found = re.search(r"first difference at \[(\d+), (\d+)\]: expected position (\d+), got (\d+)", exc.value.got)
    assert found, exc.value.got
    assert found[3] != found[4]


def uses_the_cache(probs, num_kv_heads, budget, window, kernel):
    cache = DroppingKVCache(1, 1, num_kv_heads, 2, observation_window=window)
    cache.update(0, torch.zeros(1, num_kv_heads, probs.shape[-1], 2), torch.zeros(1, num_kv_heads, probs.shape[-1], 2))
    cache.observe_attention(0, probs[None])
    cache.compress(budget, "snapkv", pool_kernel=kernel)
    return cache.key_positions(0)[0]


def test_snapkv_refuses_the_package():
    with pytest.raises(ExerciseError, match="kvcourse's own select_tokens"):
        ch08.check_snapkv_keep(select_tokens)
    with pytest.raises(ExerciseError, match="your code calls kvcourse's DroppingKVCache"):
        ch08.check_snapkv_keep(uses_the_cache)


# ---- 4. MLA's weight absorption ------------------------------------------------------------------
def absorbed_decode(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale):
    outs = []
    for h in range(q_nope.shape[0]):
        q_latent = w_uk[h].T @ q_nope[h]  # [c]
        scores = (latent @ q_latent + k_rope @ q_rope[h]) * scale  # [S]
        context = torch.softmax(scores, 0) @ latent  # [c]
        outs.append(w_uv[h] @ context)  # [v]
    return torch.stack(outs)


def expanded_decode(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale):
    keys = torch.einsum("sc,hnc->hsn", latent, w_uk)  # every head's keys, rebuilt: right, but not absorbed
    values = torch.einsum("sc,hvc->hsv", latent, w_uv)
    scores = (torch.einsum("hn,hsn->hs", q_nope, keys) + q_rope @ k_rope.T) * scale
    return torch.einsum("hs,hsv->hv", torch.softmax(scores, -1), values)


def test_mla_case_expected_is_the_layers_expanded_output():
    import random

    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for i in range(4):
        mla, args, want, layer_out = ch08._mla_case(rng, gen, i)
        heads, v_dim = want.shape
        assert torch.allclose(mla.o_proj(want.reshape(1, heads * v_dim)), layer_out[0], atol=1e-5)
        assert torch.allclose(ch08._absorbed(*args), want, atol=1e-5)


def test_mla_right_answers_pass(device):
    assert ch08.check_absorbed_decode(absorbed_decode, device=device)
    assert ch08.check_absorbed_decode(absorbed_decode, seed=2, device=device)


@pytest.mark.parametrize(
    "mistake,hint",
    [
        ("no_rope", "Add the RoPE part of the score"),
        ("no_scale", "Multiply the scores by `scale`"),
        ("softmax_heads", "not over the heads"),
        ("swapped", "they are swapped"),
    ],
)
def test_mla_mistakes_get_their_hint(mistake, hint):
    def wrong(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale):
        w_k, w_v = (w_uv, w_uk) if mistake == "swapped" else (w_uk, w_uv)
        outs = []
        scores = []
        for h in range(q_nope.shape[0]):
            s = latent @ (w_k[h].T @ q_nope[h])
            if mistake != "no_rope":
                s = s + k_rope @ q_rope[h]
            scores.append(s if mistake == "no_scale" else s * scale)
        probs = torch.softmax(torch.stack(scores), 0 if mistake == "softmax_heads" else 1)
        for h in range(q_nope.shape[0]):
            outs.append(w_v[h] @ (probs[h] @ latent))
        return torch.stack(outs)

    with pytest.raises(ExerciseError, match=re.escape(hint)):
        ch08.check_absorbed_decode(wrong)


def test_mla_expanded_form_is_refused():
    with pytest.raises(ExerciseError, match="That is the expanded form"):
        ch08.check_absorbed_decode(expanded_decode)


# ---------------------------------------------------------------------------------------------
# The error a quantizer should give, predicted from the ranges (issue 45: predict, then measure)
# ---------------------------------------------------------------------------------------------
def _mse(x, bits, dim, levels=None, per=12.0, whole=False, squared=True, mean_step=False):
    lo, hi = (x.min(), x.max()) if whole else (x.amin(dim, keepdim=True), x.amax(dim, keepdim=True))
    step = (hi - lo) / ((2**bits - 1) if levels is None else levels)
    if mean_step:
        return float(step.mean() ** 2 / per)
    return float(((step**2 if squared else step) / per).mean())


def test_rounding_mse_accepts_right_answer():
    assert ch08.check_rounding_mse(lambda x, b, d: _mse(x, b, d))
    assert ch08.check_rounding_mse(lambda x, b, d: _mse(x, b, d), seed=2)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda x, b, d: _mse(x, b, d, levels=2**b), "2\\*\\*b - 1 steps"),
        (lambda x, b, d: _mse(x, b, d, per=4), "step\\*\\*2 / 12, not step\\*\\*2 / 4"),
        (lambda x, b, d: _mse(x, b, d, whole=True), "Each group has its own range"),
        (lambda x, b, d: _mse(x, b, -2 if d % x.dim() == x.dim() - 1 else -1), "The groups run along dim"),
        (lambda x, b, d: _mse(x, b, d, squared=False), "Square the step"),
        (lambda x, b, d: _mse(x, b, d, mean_step=True), "Average the squared steps"),
        (lambda x, b, d: 1.01 * _mse(x, b, d), "predict step\\*\\*2 / 12 for each value"),
        (lambda x, b, d: "small", "a mean squared error"),
    ],
    ids=["levels", "max-error", "whole-tensor", "other-axis", "unsquared", "mean-step", "other", "not-a-number"],
)
def test_rounding_mse_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch08.check_rounding_mse(wrong)


def test_rounding_mse_refuses_the_quantizer():
    from kvcourse.compression.quantization import fake_quantize

    with pytest.raises(ExerciseError, match="fake_quantize"):
        ch08.check_rounding_mse(lambda x, b, d: float((fake_quantize(x, f"int{b}", d) - x).pow(2).mean()))
