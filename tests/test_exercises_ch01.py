"""Chapter 1's checks accept right answers and reject each typical wrong answer with its own hint.

Every wrong answer here is written independently of the check's internals, the way a learner would
write it, so a test fails if the check stops recognising that mistake.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcourse
from kvcourse.exercises import ExerciseError, ch01


# --- exercise 1: the causal mask -----------------------------------------------------------------
def right_mask(t, s):
    rows = torch.arange(t)[:, None] + (s - t)  # the position of each query
    return torch.arange(s)[None, :] <= rows


def test_mask_accepts_right_answers(capsys):
    assert ch01.check_causal_mask(right_mask)
    assert ch01.check_causal_mask(lambda t, s: torch.ones(t, s, dtype=torch.bool).tril(s - t))
    assert "Correct" in capsys.readouterr().out


def test_mask_cases_depend_on_the_seed_only():
    seen = []
    ch01.check_causal_mask(lambda t, s: seen.append((t, s)) or right_mask(t, s), seed=3)
    again = []
    ch01.check_causal_mask(lambda t, s: again.append((t, s)) or right_mask(t, s), seed=3)
    other = []
    ch01.check_causal_mask(lambda t, s: other.append((t, s)) or right_mask(t, s), seed=4)
    assert seen == again and seen != other


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda t, s: ~right_mask(t, s), "inverted"),
        (lambda t, s: torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t) + 1, "one key from its future"),
        (lambda t, s: torch.ones(t, s, dtype=torch.bool), "its future included"),
        (lambda t, s: torch.arange(s)[None, :] < torch.arange(t)[:, None] + (s - t), "diagonal is missing"),
        (lambda t, s: torch.ones(t, s, dtype=torch.bool).tril(), "LAST num_queries"),
        (lambda t, s: right_mask(t, s).T if t == s else right_mask(t, s), "transposed"),
        (lambda t, s: right_mask(t, s).int(), "torch.bool"),
        (lambda t, s: right_mask(t, s).tolist(), "torch.Tensor"),
        (lambda t, s: right_mask(s, s), "shape"),
    ],
)
def test_mask_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint) as info:
        ch01.check_causal_mask(wrong)
    message = str(info.value)
    if "shape" not in hint and "torch" not in hint:
        assert "expected:" in message and "got:" in message and "Hint:" in message


def test_mask_reports_a_crash_and_a_stub():
    with pytest.raises(ExerciseError, match="ZeroDivisionError"):
        ch01.check_causal_mask(lambda t, s: 1 / 0)

    def stub(t, s):
        raise NotImplementedError("write causal_mask")

    result = ch01.check_causal_mask(stub)  # reported, not raised: a student copy's "Run all" goes on
    assert not result and "not written yet" in result.message and "write causal_mask" in result.message
    assert not ch01.check_causal_mask(NotImplemented)  # a value answer left as the stub gives it
    with pytest.raises(ExerciseError, match="pass your function"):
        ch01.check_causal_mask(42)


# --- exercise 2: causal attention ----------------------------------------------------------------
def right_attention(q, k, v):
    t, s, d = q.shape[2], k.shape[2], q.shape[-1]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    future = torch.arange(s, device=q.device)[None, :] > torch.arange(t, device=q.device)[:, None] + (s - t)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def attention_with(q, k, v, *, scale=True, shift=0, anchored=False, interleave=False, dim=-1, mask=True):
    t, s, d = q.shape[2], k.shape[2], q.shape[-1]
    hq, hkv = q.shape[1], k.shape[1]
    if interleave:
        k, v = k.repeat(1, hq // hkv, 1, 1), v.repeat(1, hq // hkv, 1, 1)  # head h gets KV head h % Hkv
    else:
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    scores = q @ k.transpose(-1, -2)
    if scale:
        scores = scores / math.sqrt(d)
    if mask:
        pos = torch.arange(t)[:, None] + (0 if anchored else s - t) + shift
        scores = scores.masked_fill(torch.arange(s)[None, :] > pos, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=dim)) @ v


def sdpa_is_causal(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_right(q, k, v):
    t, s = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_attention_accepts_right_answers(device):
    assert ch01.check_attention(right_attention, device=device)
    assert ch01.check_attention(sdpa_right, device=device)
    assert ch01.check_attention(right_attention, seed=1, device=device)


def test_attention_hands_the_cases_over_on_its_device_argument(device):
    seen = set()

    def spy(q, k, v):
        seen.update(t.device.type for t in (q, k, v))
        return right_attention(q, k, v)

    assert ch01.check_attention(spy, device=device) and seen == {device.type}
    assert ch01.check_attention(lambda q, k, v: right_attention(q, k, v).cpu(), device=device)  # compared on the CPU
    with pytest.raises(ValueError, match="device must be a torch.device or a name"):
        ch01.check_attention(right_attention, device="nowhere")


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda q, k, v: attention_with(q, k, v, scale=False), "sqrt\\(head_dim\\)"),
        (lambda q, k, v: attention_with(q, k, v, mask=False), "No causal mask"),
        (lambda q, k, v: attention_with(q, k, v, shift=1), "one key from its future"),
        (lambda q, k, v: attention_with(q, k, v, anchored=True), "last T of the S positions"),
        (sdpa_is_causal, "is_causal=True"),
        (lambda q, k, v: attention_with(q, k, v, shift=-1), "hides the diagonal"),
        (lambda q, k, v: attention_with(q, k, v, interleave=True), "h // \\(Hq // Hkv\\)"),
        (lambda q, k, v: attention_with(q, k, v, dim=-2), "softmax runs over the queries"),
        (lambda q, k, v: q, "Scores q . k / sqrt\\(D\\)"),
        (lambda q, k, v: q[:, :, -1], "shape"),
    ],
)
def test_attention_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch01.check_attention(wrong)


def test_attention_refuses_the_package_reference():
    with pytest.raises(ExerciseError, match="kvcourse's own causal_attention"):
        ch01.check_attention(kvcourse.causal_attention)

    def wrapper(q, k, v):
        return kvcourse.causal_attention(q, k, v)

    with pytest.raises(ExerciseError, match="calls kvcourse's causal_attention"):
        ch01.check_attention(wrapper)


# --- exercise 3: the naive loop's attention pairs -------------------------------------------------
def right_pairs(p, n):
    return sum((p + i) * (p + i + 1) // 2 for i in range(n))


def test_pairs_accept_right_answers():
    assert ch01.check_naive_attention_pairs(right_pairs)
    assert ch01.check_naive_attention_pairs(lambda p, n: float(right_pairs(p, n)))

    # a closed form works as well as the loop
    def closed(p, n):
        t0, t1 = p, p + n - 1
        squares = (t1 * (t1 + 1) * (2 * t1 + 1) - (t0 - 1) * t0 * (2 * t0 - 1)) // 6
        return (squares + (t1 * (t1 + 1) - (t0 - 1) * t0) // 2) // 2 if n else 0

    assert ch01.check_naive_attention_pairs(closed)


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda p, n: sum((p + i) ** 2 for i in range(n)), "all T x T pairs"),
        (lambda p, n: sum((p + i) * (p + i - 1) // 2 for i in range(n)), "attends to itself"),
        (lambda p, n: sum((p + i) * (p + i + 1) // 2 for i in range(1, n + 1)), "Off by one step"),
        (lambda p, n: p * (p + 1) // 2 + sum(p + i for i in range(1, n)) if n else 0, "cached loop scores"),
        (lambda p, n: (p + n - 1) * (p + n) // 2, "last step alone"),
        (lambda p, n: n * p, "T = prompt_len \\+ i"),
        (lambda p, n: "many", "should return an int"),
    ],
)
def test_pairs_reject_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch01.check_naive_attention_pairs(wrong)


def test_pairs_agree_with_the_flop_count(model):
    """The check's count is the attention term of kvcourse.costs: per pair, 4 x Hq x D FLOPs in every layer."""
    from kvcourse import costs

    cfg = model.config
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    p, n = 5, 40
    linear = sum(costs.forward_flops(cfg, p + i) - per_pair * (p + i) * (p + i + 1) // 2 for i in range(n))
    assert linear == sum((p + i) * (costs.forward_flops(cfg, 1) - per_pair) for i in range(n))
    assert costs.generation_flops(cfg, p, n, use_cache=False) - linear == per_pair * right_pairs(p, n)


# --- exercise 4: what a naive step leaves unchanged ---------------------------------------------
def frozen_by_dtype(step_a, step_b, past):
    """The reference way: assert_close picks the tolerance from the dtype."""
    same = set()
    for name, a in step_a.items():
        try:
            torch.testing.assert_close(a[:past], step_b[name][:past])
        except AssertionError:
            continue
        same.add(name)
    return same


def frozen_allclose(step_a, step_b, past):  # another fair answer: one tolerance loose enough for bf16
    return sorted(
        n for n in step_a if torch.allclose(step_a[n][:past].float(), step_b[n][:past].float(), rtol=1e-2, atol=1e-3)
    )


def frozen_as_the_hint_says(step_a, step_b, past):  # the hints' remedy, taken literally: allclose, rtol=1e-2
    return {n for n in step_a if torch.allclose(step_a[n][:past], step_b[n][:past], rtol=1e-2)}


@pytest.mark.parametrize("fn", [frozen_by_dtype, frozen_allclose, frozen_as_the_hint_says])
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_frozen_accepts_right_answers(fn, seed):
    assert ch01.check_frozen_positions(fn, seed=seed)


def _loose(x, y):
    return torch.allclose(x.float(), y.float(), rtol=1e-2, atol=1e-3) if x.shape == y.shape else False


@pytest.mark.parametrize(
    ("fn", "hint"),
    [
        (lambda a, b, p: {n for n in a if torch.equal(a[n][:p], b[n][:p])}, "exact equality"),
        # issue 47: allclose's defaults fail one bf16 step; the hint says so, and no longer sends the learner there
        (lambda a, b, p: {n for n in a if torch.allclose(a[n][:p], b[n][:p])}, r"allclose's default tolerance"),
        (lambda a, b, p: {n for n in a if _loose(a[n], b[n][: len(a[n])])}, "Compare positions 0 .. past-1 only"),
        (lambda a, b, p: {n for n in a if _loose(a[n][: p - 1], b[n][: p - 1])}, "Off by one"),
        (lambda a, b, p: {n for n in a if _loose(a[n][-p:], b[n][-p:])}, "not the last rows"),
        (lambda a, b, p: set(a), "compare the first `past` positions"),
        (lambda a, b, p: "q", "should return a set of names"),
        (lambda a, b, p: {"keys"}, "not in step_a"),
        (42, "pass your function"),
    ],
)
def test_frozen_rejects_typical_mistakes_with_their_hint(fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch01.check_frozen_positions(fn)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_frozen_hints_never_send_the_learner_to_allclose_defaults(seed):
    # the learner who follows the exact-equality hint with torch.allclose as it comes gets a hint that moves on
    with pytest.raises(ExerciseError) as exc:
        ch01.check_frozen_positions(lambda a, b, p: {n for n in a if torch.allclose(a[n][:p], b[n][:p])}, seed=seed)
    assert "rtol=1e-2" in exc.value.hint and "exact equality" not in exc.value.hint
    for hint, _ in ch01._FROZEN_MISTAKES:
        assert "or torch.allclose." not in hint


def test_frozen_model_case_is_the_chapters_finding():
    # A real forward pass, twice: every past position's Q, K, V and hidden state is recomputed to the same
    # numbers; the newest token's weights over the keys change (a softmax over more keys, from another query).
    from kvcourse.exercises._core import case_generator, case_rng

    for seed in range(3):
        a, b, past = ch01._model_steps(case_generator("t", seed), case_rng("t", seed))
        assert ch01._frozen_names(a, b, past) == {"q", "k", "v", "hidden"}
        assert all(len(b[n]) > len(a[n]) == past for n in a)


def test_frozen_cases_differ_between_seeds():
    # A loop over the check cannot learn the answer: the synthetic cases' frozen names change with the seed.
    from kvcourse.exercises._core import case_generator, case_rng

    answers = set()
    for seed in range(4):
        gen, rng = case_generator("t", seed), case_rng("t", seed)
        answers.add(tuple(sorted(ch01._frozen_names(*ch01._synthetic_steps(gen, rng)))))
    assert len(answers) > 1


def test_no_reference_answers_are_public():
    for name in dir(ch01):
        obj = getattr(ch01, name)
        if callable(obj) and getattr(obj, "__module__", "") == ch01.__name__ and not name.startswith("_"):
            assert name.startswith("check_"), f"ch01.{name} is public but not a check"


# --- exercise 5: predict a naive step from the FLOPs ---------------------------------------------
def right_prediction(ms_short, short_len, long_len, per_token, per_pair):
    def flops(t):
        return per_token * t + per_pair * t * (t + 1) // 2

    return ms_short * flops(long_len) / flops(short_len)


def test_predicted_naive_step_accepts_the_flop_model(capsys):
    assert ch01.check_predicted_naive_step(right_prediction)
    assert "Correct" in capsys.readouterr().out


def test_predicted_naive_step_matches_the_package_model():
    # the check's model is costs.flop_scaled_ms, given SmolLM2's per-token and per-pair FLOPs
    cfg = kvcourse.LlamaConfig()
    per_pair = kvcourse.costs.forward_flops(cfg, 1, 1) - kvcourse.costs.forward_flops(cfg, 1, 0)
    per_token = kvcourse.costs.forward_flops(cfg, 1, 0) - per_pair
    assert math.isclose(
        right_prediction(40.0, 16, 384, per_token, per_pair),
        kvcourse.costs.flop_scaled_ms(cfg, 40.0, 16, 384),
        rel_tol=1e-12,
    )


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda ms, s, l, t, p: ms * l / s, "tokens alone"),
        (lambda ms, s, l, t, p: ms * l * l / (s * s), "square of the tokens"),
        (lambda ms, s, l, t, p: ms * (t * l + p * l**2) / (t * s + p * s**2), "all T x T"),
        (lambda ms, s, l, t, p: ms * (t * l + p * l * (l - 1) / 2) / (t * s + p * s * (s - 1) / 2), "diagonal"),
        (lambda ms, s, l, t, p: ms * (t * s + p * s * (s + 1) / 2) / (t * l + p * l * (l + 1) / 2), "Upside down"),
        (lambda ms, s, l, t, p: ms + (t * l + p * l * (l + 1) / 2) - (t * s + p * s * (s + 1) / 2), "difference"),
        (lambda ms, s, l, t, p: 1.1 * right_prediction(ms, s, l, t, p), "per_token_flops x T \\+"),
    ],
)
def test_predicted_naive_step_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint) as info:
        ch01.check_predicted_naive_step(wrong)
    assert "expected:" in str(info.value) and "got:" in str(info.value)


def test_predicted_naive_step_refuses_a_non_number():
    with pytest.raises(ExerciseError, match="finite number"):
        ch01.check_predicted_naive_step(lambda *a: "1000 ms")


def test_predicted_naive_step_refuses_the_package_model():
    cfg = kvcourse.LlamaConfig()

    def through_costs(ms, s, l, t, p):
        return kvcourse.costs.flop_scaled_ms(cfg, ms, s, l)

    with pytest.raises(ExerciseError, match="flop_scaled_ms"):
        ch01.check_predicted_naive_step(through_costs)
